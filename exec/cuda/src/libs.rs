//! Which CUDA libraries this process can load, checked before cudarc first touches them:
//! cudarc's dynamic loader panics on a missing library, so every entry point of this crate
//! asks [`check`] first and turns absence into [`MissingLibrary`], which names the library,
//! the file names tried (cudarc's own list, so that "found" here means "cudarc will find it")
//! and the directories the dynamic loader searched.

use std::sync::OnceLock;

/// A library the backend loads at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(usize)]
pub enum Lib {
    /// The driver API (libcuda, installed with the driver).
    Cuda,
    Cublas,
    /// cuBLAS loads it itself; checked so that its absence is named rather than a cuBLAS error.
    CublasLt,
    Nvrtc,
    Nccl,
}

impl Lib {
    pub const ALL: [Lib; 5] = [Lib::Cuda, Lib::Cublas, Lib::CublasLt, Lib::Nvrtc, Lib::Nccl];

    /// The stems cudarc expands into file names (`libcuda.so`, `libcuda.so.1`, ...).
    fn stems(self) -> &'static [&'static str] {
        match self {
            Lib::Cuda => &["cuda", "nvcuda"],
            Lib::Cublas => &["cublas"],
            Lib::CublasLt => &["cublasLt"],
            Lib::Nvrtc => &["nvrtc"],
            Lib::Nccl => &["nccl"],
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Lib::Cuda => "libcuda (CUDA driver)",
            Lib::Cublas => "libcublas (cuBLAS)",
            Lib::CublasLt => "libcublasLt (cuBLASLt)",
            Lib::Nvrtc => "libnvrtc (NVRTC)",
            Lib::Nccl => "libnccl (NCCL)",
        }
    }

    /// Names the library is often installed under that cudarc does not try (NCCL's packages
    /// install `libnccl.so.2` only): found under one of these, the error says to link it.
    fn other_names(self) -> &'static [&'static str] {
        match self {
            Lib::Nccl => &["libnccl.so.2"],
            _ => &[],
        }
    }
}

/// A library that cudarc would fail to load.
#[derive(Clone, Debug, thiserror::Error)]
#[error(
    "{} is not loadable: tried {} in {}{}",
    lib.name(),
    tried.join(", "),
    if dirs.is_empty() { "the system library path".to_string() } else { format!("LD_LIBRARY_PATH ({}) and the system library path", dirs.join(":")) },
    match found_as { Some(f) => format!("; it is installed as `{f}`, a name cudarc does not load: make a symlink named `{}` to it in a directory on LD_LIBRARY_PATH", tried.first().map_or("", String::as_str)), None => String::new() }
)]
pub struct MissingLibrary {
    pub lib: Lib,
    /// File names tried, in cudarc's order.
    pub tried: Vec<String>,
    /// The directories of `LD_LIBRARY_PATH` (searched before the system path).
    pub dirs: Vec<String>,
    /// The library was found under a name cudarc does not try.
    pub found_as: Option<String>,
}

/// Checks that cudarc can load `lib`; the answer is cached for the process.
pub fn check(lib: Lib) -> Result<(), Box<MissingLibrary>> {
    static DONE: [OnceLock<Result<(), MissingLibrary>>; 5] = [const { OnceLock::new() }; 5];
    let slot = &DONE[lib as usize];
    slot.get_or_init(|| probe_names(lib, lib.stems(), lib.other_names()))
        .clone()
        .map_err(Box::new)
}

/// Checks every library in `libs`, first missing one reported.
pub fn check_all(libs: &[Lib]) -> Result<(), Box<MissingLibrary>> {
    libs.iter().try_for_each(|l| check(*l))
}

/// Tries cudarc's file names for each of `stems`; on failure, whether any of `others` loads.
fn probe_names(lib: Lib, stems: &[&str], others: &[&str]) -> Result<(), MissingLibrary> {
    let mut tried: Vec<String> = Vec::new();
    for name in stems
        .iter()
        .flat_map(|s| cudarc::get_lib_name_candidates(s))
    {
        if !tried.contains(&name) {
            tried.push(name);
        }
    }
    if tried.iter().any(|name| loads(name)) {
        return Ok(());
    }
    let dirs = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|d| !d.is_empty())
        .map(str::to_string)
        .collect();
    let found_as = others.iter().find(|n| loads(n)).map(|n| n.to_string());
    Err(MissingLibrary {
        lib,
        tried,
        dirs,
        found_as,
    })
}

fn loads(name: &str) -> bool {
    // SAFETY: loading a CUDA library runs its initialisers, which have no preconditions; the
    // handle is closed again at once (cudarc opens its own).
    unsafe { libloading::Library::new(name) }.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_names_itself_the_names_tried_and_the_path() {
        let e = probe_names(
            Lib::Nccl,
            &["zerosched-no-such-lib"],
            &["libzerosched-absent.so.2"],
        )
        .unwrap_err();
        assert_eq!(e.lib, Lib::Nccl);
        assert_eq!(
            e.tried.first().map(String::as_str),
            Some("libzerosched-no-such-lib.so")
        );
        assert!(
            e.tried.len() > 5,
            "cudarc's whole candidate list: {:?}",
            e.tried
        );
        assert_eq!(e.found_as, None);
        let msg = e.to_string();
        assert!(
            msg.starts_with("libnccl (NCCL) is not loadable: tried libzerosched-no-such-lib.so,"),
            "{msg}"
        );
        assert!(msg.contains("system library path"), "{msg}");
    }

    #[test]
    fn a_library_under_a_name_cudarc_skips_says_to_link_it() {
        // glibc's libc.so.6 is loadable everywhere; it stands for `libnccl.so.2` here.
        let e = probe_names(Lib::Nccl, &["zerosched-no-such-lib"], &["libc.so.6"]).unwrap_err();
        assert_eq!(e.found_as.as_deref(), Some("libc.so.6"));
        let msg = e.to_string();
        assert!(
            msg.contains("installed as `libc.so.6`")
                && msg.contains("symlink named `libzerosched-no-such-lib.so`"),
            "{msg}"
        );
    }

    #[test]
    fn a_present_library_passes() {
        // Every Rust program on Linux loads libgcc_s.so.1 (unwinding); cudarc tries `.so.1`.
        assert!(probe_names(Lib::Cuda, &["gcc_s"], &[]).is_ok());
    }
}
