//! NCCL, loaded at run time like the other CUDA libraries, and found under the name its
//! packages install.
//!
//! cudarc's `nccl` module opens the library under the names cudarc tries for every CUDA library
//! (`libnccl.so`, `libnccl.so.13`, `libnccl.so.12`, ...), none of which NCCL's own packages
//! install: the NVIDIA packages and PyTorch's wheels ship `libnccl.so.2` alone (`libnccl.so` comes
//! only with the development package). So the engine opens NCCL itself, by its soname first and
//! then by cudarc's names, and calls it with the declarations of cudarc's `nccl::sys`.

use cudarc::nccl::sys::ncclResult_t;
use libloading::Library;
use std::ffi::c_int;
use std::sync::OnceLock;

/// NCCL's soname: the name its packages install the library under.
const SONAME: &str = "libnccl.so.2";

/// The names NCCL is opened under, in order: its soname, then cudarc's names for it.
pub fn library_names() -> Vec<String> {
    let mut names = vec![SONAME.to_string()];
    for name in cudarc::get_lib_name_candidates("nccl") {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// NCCL's version, decoded from `ncclGetVersion`'s code (`major·10000 + minor·100 + patch` since
/// NCCL 2.9).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NcclVersion {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch level.
    pub patch: u32,
}

impl NcclVersion {
    /// The version of `code`, as `ncclGetVersion` gives it.
    pub fn from_code(code: u32) -> Self {
        NcclVersion {
            major: code / 10000,
            minor: code / 100 % 100,
            patch: code % 100,
        }
    }
}

impl std::fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The oldest NCCL the engine takes: 2.18, the oldest cudarc declares (its `nccl-02018`).
pub const OLDEST: NcclVersion = NcclVersion {
    major: 2,
    minor: 18,
    patch: 0,
};

type GetVersion = unsafe extern "C" fn(*mut c_int) -> ncclResult_t;

/// The NCCL library opened, and its version.
pub struct Nccl {
    /// The name it was opened under.
    name: String,
    version: NcclVersion,
    /// The library, open for the life of the process.
    _lib: Library,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NCCL {} ({})", self.version, self.name)
    }
}

impl Nccl {
    /// NCCL, opened once per process: the first of [`library_names`] that opens, or why none
    /// could be used (none found, an entry missing, a version older than [`OLDEST`]).
    pub fn get() -> Result<&'static Nccl, String> {
        static NCCL: OnceLock<Result<Nccl, String>> = OnceLock::new();
        NCCL.get_or_init(Nccl::open).as_ref().map_err(Clone::clone)
    }

    fn open() -> Result<Nccl, String> {
        let names = library_names();
        // SAFETY: opening NCCL runs no initialisation of its own beyond its static constructors.
        let (name, lib) = names
            .iter()
            .find_map(|n| unsafe { Library::new(n) }.ok().map(|lib| (n.clone(), lib)))
            .ok_or_else(|| {
                format!(
                    "NCCL could not be loaded under any of {}; install NCCL (PyTorch's CUDA wheels \
                     bring it: site-packages/nvidia/nccl/lib) and put its directory on \
                     LD_LIBRARY_PATH",
                    names.join(", ")
                )
            })?;
        // SAFETY: the type is nccl.h's, as cudarc's declarations give it.
        let get_version = unsafe { lib.get::<GetVersion>(b"ncclGetVersion") }
            .map(|f| *f)
            .map_err(|e| format!("{name} has no ncclGetVersion: {e}"))?;
        let mut code: c_int = 0;
        // SAFETY: the pointer is valid for writing an int.
        let got = unsafe { get_version(&mut code) };
        if got != ncclResult_t::ncclSuccess {
            return Err(format!("ncclGetVersion failed in {name}: {got:?}"));
        }
        let version = NcclVersion::from_code(code.max(0) as u32);
        if version < OLDEST {
            return Err(format!(
                "{name} is NCCL {version}; the engine needs NCCL {OLDEST} or later"
            ));
        }
        Ok(Nccl {
            name,
            version,
            _lib: lib,
        })
    }

    /// The name the library was opened under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The library's version.
    pub fn version(&self) -> NcclVersion {
        self.version
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soname_is_tried_first_and_cudarcs_names_after_it() {
        let names = library_names();
        assert_eq!(names[0], "libnccl.so.2");
        assert!(names.iter().any(|n| n == "libnccl.so"), "{names:?}");
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "{names:?}");
    }

    #[test]
    fn version_codes_decode_as_nccl_encodes_them() {
        let v = NcclVersion::from_code(23007);
        assert_eq!((v.major, v.minor, v.patch), (2, 30, 7));
        assert_eq!(v.to_string(), "2.30.7");
        assert!(NcclVersion::from_code(21805) < NcclVersion::from_code(23007));
        assert!(NcclVersion::from_code(21704) < OLDEST);
    }
}
