//! The bearer token: one secret read from a file, compared in constant time. It never appears
//! in a log line, an error or a metric.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use super::AccessError;

/// A token longer than this is not a token someone meant to put in a header.
const MAX_TOKEN_BYTES: usize = 4096;

pub struct BearerToken {
    path: PathBuf,
    token: RwLock<Arc<[u8]>>,
}

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BearerToken")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<Arc<[u8]>, AccessError> {
    let what = "--auth-token-file";
    let raw = std::fs::read(path).map_err(|source| AccessError::Read {
        what,
        path: path.into(),
        source,
    })?;
    let invalid = |message: &str| AccessError::Invalid {
        what,
        path: path.into(),
        message: message.into(),
    };
    let token = raw.trim_ascii();
    if token.is_empty() {
        return Err(invalid("the file is empty"));
    }
    if token.len() > MAX_TOKEN_BYTES {
        return Err(invalid("the token is longer than 4096 bytes"));
    }
    // What an HTTP header value can carry after `Bearer `, without spaces.
    if !token.iter().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(
            "the token must be printable ASCII without spaces or control characters",
        ));
    }
    Ok(token.into())
}

impl BearerToken {
    pub fn load(path: PathBuf) -> Result<BearerToken, AccessError> {
        let token = read(&path)?;
        Ok(BearerToken {
            path,
            token: RwLock::new(token),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the file again; on error the token in force stays.
    pub fn reload(&self) -> Result<(), AccessError> {
        let fresh = read(&self.path)?;
        *self.token.write().unwrap_or_else(|p| p.into_inner()) = fresh;
        Ok(())
    }

    /// Whether an `authorization` header value is `Bearer <the token>` (scheme in any case).
    pub fn admits(&self, authorization: Option<&[u8]>) -> bool {
        let Some(value) = authorization else {
            return false;
        };
        let Some((scheme, given)) = value.split_first_chunk::<7>() else {
            return false;
        };
        if !scheme.eq_ignore_ascii_case(b"bearer ") {
            return false;
        }
        let token = self.token.read().unwrap_or_else(|p| p.into_inner()).clone();
        constant_time_eq(given.trim_ascii(), &token)
    }
}

/// Equal slices, in time that depends on their lengths only (not on where they differ).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token_file(name: &str, content: &[u8]) -> PathBuf {
        let p = std::env::temp_dir().join(format!("revenant-token-{name}-{}", std::process::id()));
        std::fs::write(&p, content).unwrap();
        p
    }

    #[test]
    fn only_the_bearer_token_is_admitted_and_rotation_replaces_it() {
        let p = token_file("rotate", b"s3cr3t-Token_1\n");
        let t = BearerToken::load(p.clone()).unwrap();
        assert!(t.admits(Some(b"Bearer s3cr3t-Token_1")));
        assert!(t.admits(Some(b"bearer s3cr3t-Token_1")));
        for refused in [
            None,
            Some(&b""[..]),
            Some(b"Bearer"),
            Some(b"Bearer "),
            Some(b"Basic s3cr3t-Token_1"),
            Some(b"Bearer s3cr3t-Token_2"),
            Some(b"Bearer s3cr3t-Token_1x"),
            Some(b"s3cr3t-Token_1"),
        ] {
            assert!(!t.admits(refused), "{refused:?}");
        }
        std::fs::write(&p, b"next-token").unwrap();
        t.reload().unwrap();
        assert!(t.admits(Some(b"Bearer next-token")));
        assert!(!t.admits(Some(b"Bearer s3cr3t-Token_1")));
        // A broken file keeps the token in force.
        std::fs::write(&p, b"  \n").unwrap();
        assert!(t.reload().is_err());
        assert!(t.admits(Some(b"Bearer next-token")));
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn bad_token_files_are_named_and_the_token_is_never_printed() {
        let missing = std::env::temp_dir().join("revenant-token-does-not-exist");
        let e = BearerToken::load(missing.clone()).unwrap_err().to_string();
        assert!(e.contains(&missing.display().to_string()), "{e}");
        for (name, content, want) in [
            ("empty", &b"\n"[..], "empty"),
            ("space", b"two words", "printable ASCII"),
            ("long", &[b'a'; 5000][..], "longer"),
        ] {
            let p = token_file(name, content);
            let e = BearerToken::load(p.clone()).unwrap_err().to_string();
            assert!(
                e.contains(want) && e.contains(&p.display().to_string()),
                "{e}"
            );
            assert!(!e.contains("two words"), "{e}");
            let _ = std::fs::remove_file(&p);
        }
    }
}
