//! How the ranks of a run find each other, as `torchrun` and Slurm launch PyTorch jobs: `RANK`,
//! `WORLD_SIZE` and `LOCAL_RANK` in the environment, and `MASTER_ADDR:MASTER_PORT`, where
//! rank 0 serves the NCCL unique id over TCP to the others (plain TCP, so that it works across
//! nodes as well as within one). The exchange is a magic word and the 128-byte id.

use crate::error::{CudaError, Result};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;
const MAGIC: &[u8; 8] = b"ZSNCCL01";

/// This process's place in the run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub rank: u32,
    pub world: u32,
    /// The GPU ordinal on this node.
    pub local_rank: u32,
    /// `MASTER_ADDR:MASTER_PORT` (required when `world > 1`).
    pub master: Option<String>,
}

impl Launch {
    /// The launch the environment describes; `None` when `RANK` and `WORLD_SIZE` are unset.
    pub fn from_env() -> Result<Option<Launch>> {
        Launch::from_vars(|k| std::env::var(k).ok())
    }

    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        let num = |k: &str| -> Result<Option<u32>> {
            var(k)
                .map(|v| {
                    v.trim().parse::<u32>().map_err(|_| {
                        CudaError::Env(format!("{k}={v:?} is not a non-negative integer"))
                    })
                })
                .transpose()
        };
        let (rank, world) = match (num("RANK")?, num("WORLD_SIZE")?) {
            (None, None) => return Ok(None),
            (Some(r), Some(w)) => (r, w),
            _ => {
                return Err(CudaError::Env(
                    "RANK and WORLD_SIZE must be set together".into(),
                ));
            }
        };
        if world == 0 || rank >= world {
            return Err(CudaError::Env(format!(
                "RANK={rank} is not below WORLD_SIZE={world}"
            )));
        }
        let local_rank = num("LOCAL_RANK")?.unwrap_or(rank);
        let master = match (var("MASTER_ADDR"), var("MASTER_PORT")) {
            (Some(a), Some(p)) => Some(format!("{a}:{p}")),
            (None, Some(p)) => Some(format!("127.0.0.1:{p}")),
            _ if world == 1 => None,
            _ => {
                return Err(CudaError::Env(format!(
                    "WORLD_SIZE={world} needs MASTER_PORT (and MASTER_ADDR off node)"
                )));
            }
        };
        Ok(Some(Launch {
            rank,
            world,
            local_rank,
            master,
        }))
    }
}

/// Rank 0's server: answers `peers` connections with `id`, in the background.
pub struct Server {
    addr: String,
    thread: JoinHandle<Result<()>>,
}

impl Server {
    /// Binds `addr` now (so a taken port is an error here) and serves in a thread.
    pub fn start(addr: &str, id: [u8; ID_BYTES], peers: u32, timeout: Duration) -> Result<Server> {
        let err = |m: String| CudaError::Rendezvous {
            addr: addr.to_string(),
            message: m,
        };
        let listener = TcpListener::bind(addr).map_err(|e| err(format!("cannot listen: {e}")))?;
        let a = addr.to_string();
        let thread = std::thread::spawn(move || {
            let err = |m: String| CudaError::Rendezvous {
                addr: a.clone(),
                message: m,
            };
            listener
                .set_nonblocking(true)
                .map_err(|e| err(e.to_string()))?;
            let deadline = Instant::now() + timeout;
            let mut served = 0;
            while served < peers {
                match listener.accept() {
                    Ok((mut s, _)) => {
                        s.set_nonblocking(false).map_err(|e| err(e.to_string()))?;
                        s.write_all(MAGIC)
                            .and_then(|()| s.write_all(&id))
                            .map_err(|e| err(format!("sending the id: {e}")))?;
                        served += 1;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
                            return Err(err(format!(
                                "{served} of {peers} ranks connected within {timeout:?}"
                            )));
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => return Err(err(format!("accept: {e}"))),
                }
            }
            Ok(())
        });
        Ok(Server {
            addr: addr.to_string(),
            thread,
        })
    }

    /// Waits until every peer has its id.
    pub fn finish(self) -> Result<()> {
        self.thread.join().map_err(|_| CudaError::Rendezvous {
            addr: self.addr,
            message: "the server thread panicked".into(),
        })?
    }
}

/// Fetches the id from rank 0 at `addr`, retrying the connection until `timeout` (rank 0 may
/// start later than this rank).
pub fn fetch(addr: &str, timeout: Duration) -> Result<[u8; ID_BYTES]> {
    let err = |m: String| CudaError::Rendezvous {
        addr: addr.to_string(),
        message: m,
    };
    let deadline = Instant::now() + timeout;
    let mut s = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => {
                return Err(err(format!("no rank 0 within {timeout:?}: {e}")));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    s.set_read_timeout(Some(timeout))
        .map_err(|e| err(e.to_string()))?;
    let mut magic = [0u8; 8];
    let mut id = [0u8; ID_BYTES];
    s.read_exact(&mut magic)
        .and_then(|()| s.read_exact(&mut id))
        .map_err(|e| err(format!("reading the id: {e}")))?;
    if &magic != MAGIC {
        return Err(err("the server is not a zerosched rank 0".into()));
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn launch(vars: &[(&str, &str)]) -> Result<Option<Launch>> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Launch::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn the_environment_gives_rank_world_local_rank_and_master() {
        assert_eq!(launch(&[]).unwrap(), None);
        let l = launch(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((l.rank, l.world, l.local_rank), (3, 8, 1));
        assert_eq!(l.master.as_deref(), Some("node0:29500"));
        let one = launch(&[("RANK", "0"), ("WORLD_SIZE", "1")])
            .unwrap()
            .unwrap();
        assert_eq!((one.local_rank, one.master), (0, None));
    }

    #[test]
    fn a_bad_environment_is_a_typed_error() {
        for (vars, needle) in [
            (&[("RANK", "1")][..], "set together"),
            (&[("RANK", "2"), ("WORLD_SIZE", "2")][..], "not below"),
            (&[("RANK", "x"), ("WORLD_SIZE", "2")][..], "RANK=\"x\""),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "2")][..],
                "needs MASTER_PORT",
            ),
        ] {
            let e = launch(vars).unwrap_err().to_string();
            assert!(e.contains(needle), "{vars:?}: {e}");
        }
    }

    #[test]
    fn ranks_fetch_the_id_rank_0_serves_over_loopback() {
        let addr = {
            // A free port: bind to 0, read it, release it.
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let mut id = [0u8; ID_BYTES];
        id.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = i as u8 ^ 0x5a);
        let server = Server::start(&addr, id, 3, Duration::from_secs(10)).unwrap();
        let peers: Vec<_> = (0..3)
            .map(|_| {
                let a = addr.clone();
                std::thread::spawn(move || fetch(&a, Duration::from_secs(10)))
            })
            .collect();
        for p in peers {
            assert_eq!(p.join().unwrap().unwrap(), id);
        }
        server.finish().unwrap();
    }

    #[test]
    fn a_rank_0_that_never_comes_is_a_timeout_naming_the_address() {
        let addr = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let e = fetch(&addr, Duration::from_millis(100))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!("rendezvous at {addr}: no rank 0 within")),
            "{e}"
        );
        let lonely = Server::start(&addr, [0; ID_BYTES], 1, Duration::from_millis(50)).unwrap();
        let e = lonely.finish().unwrap_err().to_string();
        assert!(e.contains("0 of 1 ranks connected"), "{e}");
    }
}
