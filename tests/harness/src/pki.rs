//! A throwaway PKI for TLS tests, made with `openssl`: a CA, a server certificate for 127.0.0.1
//! and a client certificate, in a directory removed on drop.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use crate::binaries::system_bin;

/// A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA.
pub struct Pki {
    pub dir: PathBuf,
}

fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

impl Pki {
    /// A fresh PKI under the temporary directory, `name` keeping tests apart.
    pub fn new(name: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("revenant-pki-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let pki = Pki { dir };
        run_ok(
            Command::new(system_bin("openssl"))
                .current_dir(&pki.dir)
                .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
                .args(["ec_paramgen_curve:P-256", "-nodes", "-days", "2"])
                .args(["-keyout", "ca.key", "-out", "ca.crt"])
                .args(["-subj", "/CN=revenant-test-ca"])
                .args(["-addext", "basicConstraints=critical,CA:TRUE"])
                .args(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]),
        );
        pki.leaf("server", "revenant-server-1", "serverAuth");
        pki.leaf("client", "revenant-client", "clientAuth");
        pki
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    pub fn path_str(&self, file: &str) -> String {
        self.path(file).display().to_string()
    }

    /// `<name>.key` and `<name>.crt` signed by the CA, for 127.0.0.1.
    pub fn leaf(&self, name: &str, cn: &str, usage: &str) {
        let ext = self.path(&format!("{name}.ext"));
        std::fs::write(
            &ext,
            format!(
                "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
                 keyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n"
            ),
        )
        .unwrap();
        run_ok(
            Command::new(system_bin("openssl"))
                .current_dir(&self.dir)
                .args([
                    "req",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:P-256",
                ])
                .args(["-nodes", "-keyout", &format!("{name}.key")])
                .args([
                    "-out",
                    &format!("{name}.csr"),
                    "-subj",
                    &format!("/CN={cn}"),
                ]),
        );
        run_ok(
            Command::new(system_bin("openssl"))
                .current_dir(&self.dir)
                .args(["x509", "-req", "-in", &format!("{name}.csr"), "-days", "2"])
                .args(["-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial"])
                .args([
                    "-out",
                    &format!("{name}.crt"),
                    "-extfile",
                    &format!("{name}.ext"),
                ]),
        );
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
