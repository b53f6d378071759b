//! Reading and writing documents by file name: JSON, gzip-compressed JSON, or the binary form.
//! Output files are written whole or not at all (a temporary file beside the target, renamed).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use zerosched_ir::{ImportError, Program};

#[derive(Debug, thiserror::Error)]
pub enum IoError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Import { path: PathBuf, source: ImportError },
}

/// The encodings a document can be written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Encoding {
    Json,
    /// gzip-compressed JSON (`.json.gz`)
    JsonGz,
    /// zerosched's binary form (`.zsg`)
    Binary,
}

impl Encoding {
    /// From the file name: `.zsg` is binary, `.gz` compressed JSON, anything else JSON.
    pub fn from_path(path: &Path) -> Encoding {
        match path.extension().and_then(|e| e.to_str()) {
            Some("zsg") => Encoding::Binary,
            Some("gz") => Encoding::JsonGz,
            _ => Encoding::Json,
        }
    }
}

/// Reads a file's bytes, decompressing gzip (recognised by its magic bytes, not its name).
pub fn read_bytes(path: &Path) -> Result<Vec<u8>, IoError> {
    let err = |source| IoError::Read {
        path: path.to_owned(),
        source,
    };
    let raw = std::fs::read(path).map_err(err)?;
    gunzip_if_needed(raw).map_err(err)
}

pub fn gunzip_if_needed(raw: Vec<u8>) -> std::io::Result<Vec<u8>> {
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::with_capacity(raw.len() * 8);
        flate2::read::MultiGzDecoder::new(raw.as_slice()).read_to_end(&mut out)?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// Reads and imports a document in any encoding.
pub fn read_program(path: &Path) -> Result<Program, IoError> {
    let bytes = read_bytes(path)?;
    zerosched_ir::import(&bytes).map_err(|source| IoError::Import {
        path: path.to_owned(),
        source,
    })
}

/// Encodes a program.
pub fn encode(program: &Program, encoding: Encoding) -> Vec<u8> {
    match encoding {
        Encoding::Json => zerosched_ir::json::export(program),
        Encoding::JsonGz => gzip(&zerosched_ir::json::export(program)),
        Encoding::Binary => zerosched_ir::binary::export(program),
    }
}

/// gzip with no timestamp or name in the header, so equal input gives equal bytes.
fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), flate2::Compression::default());
    // Writing into a Vec cannot fail.
    let _ = enc.write_all(bytes);
    enc.finish().unwrap_or_default()
}

/// A temporary file beside the target, readable as an ordinary output file is (tempfile's
/// default is owner-only).
fn temp_file(dir: &Path) -> std::io::Result<tempfile::NamedTempFile> {
    let mut b = tempfile::Builder::new();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        b.permissions(std::fs::Permissions::from_mode(0o644));
    }
    b.tempfile_in(dir)
}

/// Writes `bytes` to `path` atomically: a reader sees the old file or the whole new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), IoError> {
    let err = |source| IoError::Write {
        path: path.to_owned(),
        source,
    };
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut tmp = temp_file(dir).map_err(err)?;
    tmp.write_all(bytes).map_err(err)?;
    tmp.as_file().sync_all().map_err(err)?;
    tmp.persist(path).map_err(|e| err(e.error))?;
    Ok(())
}
