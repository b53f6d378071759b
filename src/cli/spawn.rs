//! `zerosched run --executor cuda --world-size N` without a launcher's variables: this process
//! starts the N local ranks itself, as torchrun would, each a child process of the same binary
//! with the same arguments and `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR` and
//! `MASTER_PORT` (a port free on this host) set. Their output is forwarded line by line,
//! prefixed with the rank; a rank that fails fails the run, naming it, and the others are
//! killed rather than left waiting in a collective for it.

use super::Failure;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

/// Runs this command line again as every rank of a local world of `world`.
pub fn local_ranks(world: u32) -> Result<(), Failure> {
    let exe = std::env::current_exe()?;
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    let port = free_port()?;
    let ranks = (0..world)
        .map(|rank| {
            let mut c = Command::new(&exe);
            c.args(&args).envs(rank_env(rank, world, port));
            (rank, c)
        })
        .collect();
    Ok(supervise(ranks)?)
}

/// The launch variables of local rank `rank` (its GPU ordinal too).
pub fn rank_env(rank: u32, world: u32, port: u16) -> [(&'static str, String); 5] {
    [
        ("RANK", rank.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_owned()),
        ("MASTER_PORT", port.to_string()),
    ]
}

/// A TCP port nothing listens on now (the kernel's pick), for rank 0's rendezvous.
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port())
}

/// Copies `from`'s lines to `to`, each prefixed with `tag`.
fn forward(
    from: impl Read + Send + 'static,
    tag: String,
    to: fn() -> Box<dyn Write>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines() {
            let Ok(line) = line else { break };
            // One write per line, so that ranks' lines never interleave mid-line.
            let _ = to().write_all(format!("{tag}{line}\n").as_bytes());
        }
    })
}

/// Starts every `(rank, command)` with its output forwarded, and waits for them all. The
/// first rank to exit unsuccessfully (or to fail to start) stops the others and is the error.
pub fn supervise(ranks: Vec<(u32, Command)>) -> Result<(), String> {
    let mut running: Vec<(u32, Child)> = Vec::with_capacity(ranks.len());
    let mut pipes = Vec::new();
    for (rank, mut c) in ranks {
        c.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        match c.spawn() {
            Ok(mut child) => {
                let tag = format!("[rank {rank}] ");
                if let Some(out) = child.stdout.take() {
                    pipes.push(forward(out, tag.clone(), || Box::new(std::io::stdout())));
                }
                if let Some(err) = child.stderr.take() {
                    pipes.push(forward(err, tag, || Box::new(std::io::stderr())));
                }
                running.push((rank, child));
            }
            Err(e) => {
                stop(&mut running);
                return Err(format!("rank {rank} could not start: {e}"));
            }
        }
    }
    wait_all(&mut running)?;
    // Every rank exited: their output ends with them. (After a failure the forwarders are
    // left to finish alone: a killed rank's own children may hold its pipes open.)
    for p in pipes {
        let _ = p.join();
    }
    Ok(())
}

/// Polls the children until all have succeeded or one has failed (then the rest are killed).
fn wait_all(running: &mut Vec<(u32, Child)>) -> Result<(), String> {
    while !running.is_empty() {
        let mut i = 0;
        while i < running.len() {
            let (rank, child) = &mut running[i];
            let rank = *rank;
            match child.try_wait() {
                Ok(None) => i += 1,
                Ok(Some(status)) if status.success() => {
                    running.remove(i);
                }
                Ok(Some(status)) => {
                    running.remove(i);
                    let others = running.len();
                    stop(running);
                    return Err(failed(rank, status, others));
                }
                Err(e) => {
                    running.remove(i);
                    stop(running);
                    return Err(format!("rank {rank}: waiting for it failed: {e}"));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn failed(rank: u32, status: ExitStatus, others: usize) -> String {
    let how = match status.code() {
        Some(c) => format!("exited with status {c}"),
        None => format!("was killed ({status})"),
    };
    if others == 0 {
        format!("rank {rank} {how}")
    } else {
        format!("rank {rank} {how}; the {others} rank(s) still running were stopped")
    }
}

/// Kills and reaps every child still running.
fn stop(running: &mut Vec<(u32, Child)>) {
    for (_, c) in running.iter_mut() {
        let _ = c.kill();
    }
    for (_, mut c) in running.drain(..) {
        let _ = c.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    #[test]
    fn each_rank_gets_its_launch_variables() {
        let env = rank_env(3, 8, 29500);
        let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("RANK"), Some("3"));
        assert_eq!(get("LOCAL_RANK"), Some("3"));
        assert_eq!(get("WORLD_SIZE"), Some("8"));
        assert_eq!(get("MASTER_ADDR"), Some("127.0.0.1"));
        assert_eq!(get("MASTER_PORT"), Some("29500"));
        assert!(free_port().unwrap() > 0);
    }

    #[test]
    fn ranks_that_all_succeed_are_a_success() {
        let ranks = (0..3)
            .map(|r| {
                let mut c = sh("test \"$RANK\" -lt \"$WORLD_SIZE\" && echo \"rank $RANK up\"");
                c.envs(rank_env(r, 3, 1));
                (r, c)
            })
            .collect();
        assert_eq!(supervise(ranks), Ok(()));
    }

    #[test]
    fn a_failing_rank_fails_the_run_naming_it_and_stops_the_others() {
        let started = Instant::now();
        let ranks = vec![
            (0, sh("sleep 30")),
            (1, sh("echo 'boom' >&2; exit 3")),
            (2, sh("sleep 30")),
        ];
        let e = supervise(ranks).unwrap_err();
        assert_eq!(
            e,
            "rank 1 exited with status 3; the 2 rank(s) still running were stopped"
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the sleeping ranks were killed, not waited for"
        );
    }

    #[test]
    fn a_rank_that_cannot_start_is_named() {
        let ranks = vec![
            (0, sh("sleep 30")),
            (1, Command::new("/nonexistent/zerosched")),
        ];
        let e = supervise(ranks).unwrap_err();
        assert!(e.starts_with("rank 1 could not start: "), "{e}");
    }
}
