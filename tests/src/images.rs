//! Locally built OCI images for the containerd tests: no registry is reachable here.
//!
//! Two images, each an OCI image-layout tarball (`oci-layout`, `index.json`, `blobs/sha256/…`)
//! with one uncompressed layer, that `ctr images import` accepts and CRI then finds without a pull:
//! - busybox: Debian's busybox-static as `/bin/busybox`, a `/bin/<applet>` symlink for every applet
//!   it lists, and the usual empty top-level directories plus a root-only `/etc/passwd`;
//! - pause: `tests/images/pause.c` compiled with `gcc -static` as `/pause`, the pod sandbox image.
//!
//! The tarballs are deterministic (fixed mtimes, owners and entry order) and cached in the build
//! directory; they are rewritten only when their content changes.

use sha2::{Digest, Sha256};
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Name under which the busybox image is imported.
pub const BUSYBOX_IMAGE: &str = "localhost/microvm-test/busybox:latest";
/// Name under which the pause image is imported (the private containerd's `sandbox_image`).
pub const PAUSE_IMAGE: &str = "localhost/microvm-test/pause:latest";

const BUSYBOX_BINARY: &str = "/bin/busybox";
const PAUSE_SOURCE: &str = include_str!("../images/pause.c");
const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("{0} not found: install Debian's busybox-static (scripts/install-deps.sh)")]
    MissingBusybox(String),
    #[error("`{command}` failed: {detail}")]
    Command { command: String, detail: String },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ImageError {
    let what = what.into();
    move |source| ImageError::Io { what, source }
}

/// An image tarball on disk and the name it is imported under.
#[derive(Debug, Clone)]
pub struct LocalImage {
    pub name: &'static str,
    pub tarball: PathBuf,
}

/// The directory the image tarballs are cached in: `$MICROVM_IMAGE_DIR`, else `build/images` at
/// the workspace root.
pub fn default_image_dir() -> PathBuf {
    match std::env::var_os("MICROVM_IMAGE_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../build/images"),
    }
}

/// Builds (or reuses) the busybox image tarball in `dir`.
pub fn busybox_image(dir: &Path) -> Result<LocalImage, ImageError> {
    let busybox = Path::new(BUSYBOX_BINARY);
    if !busybox.is_file() {
        return Err(ImageError::MissingBusybox(BUSYBOX_BINARY.into()));
    }
    let binary = std::fs::read(busybox).map_err(io_err(format!("read {BUSYBOX_BINARY}")))?;
    let applets = busybox_applets()?;

    let mut layer = LayerBuilder::new();
    for d in [
        "bin", "dev", "etc", "proc", "root", "sys", "usr", "usr/bin", "var",
    ] {
        layer.dir(d, 0o755)?;
    }
    layer.dir("tmp", 0o1777)?;
    layer.file("bin/busybox", 0o755, &binary)?;
    for applet in applets.iter().filter(|a| a.as_str() != "busybox") {
        layer.symlink(&format!("bin/{applet}"), "busybox")?;
    }
    layer.file("etc/passwd", 0o644, b"root:x:0:0:root:/root:/bin/sh\n")?;
    layer.file("etc/group", 0o644, b"root:x:0:\n")?;
    let config = serde_json::json!({
        "Env": [DEFAULT_PATH],
        "Cmd": ["sh"],
    });
    write_image(dir, "busybox.tar", BUSYBOX_IMAGE, layer.finish()?, config)
}

/// Builds (or reuses) the pause image tarball in `dir`; compiles the pause program with
/// `gcc -static` unless a binary of the same source is cached.
pub fn pause_image(dir: &Path) -> Result<LocalImage, ImageError> {
    std::fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
    let source_hash = &hex_sha256(PAUSE_SOURCE.as_bytes())[..16];
    let binary_path = dir.join(format!("pause-{source_hash}"));
    if !binary_path.is_file() {
        // Unique names: tests in parallel (threads and processes) may build it at once.
        let source = unique_tmp(dir, &format!("pause-{source_hash}"), ".c");
        std::fs::write(&source, PAUSE_SOURCE).map_err(io_err("write pause.c"))?;
        let tmp = unique_tmp(dir, &format!("pause-{source_hash}"), ".tmp");
        let compiled = run(Command::new("gcc")
            .args(["-static", "-Os", "-s", "-Wall", "-o"])
            .arg(&tmp)
            .arg(&source));
        let _ = std::fs::remove_file(&source);
        compiled?;
        std::fs::rename(&tmp, &binary_path).map_err(io_err("rename pause binary"))?;
    }
    let binary = std::fs::read(&binary_path).map_err(io_err("read pause binary"))?;
    let mut layer = LayerBuilder::new();
    layer.file("pause", 0o755, &binary)?;
    let config = serde_json::json!({
        "Env": [DEFAULT_PATH],
        "Entrypoint": ["/pause"],
    });
    write_image(dir, "pause.tar", PAUSE_IMAGE, layer.finish()?, config)
}

/// Imports an image tarball with `ctr images import`; `ctr` is a command for the containerd
/// and namespace to import into (e.g. `PrivateContainerd::ctr_command`).
pub fn import(mut ctr: Command, image: &LocalImage) -> Result<(), ImageError> {
    run(ctr.args(["images", "import"]).arg(&image.tarball))
}

fn busybox_applets() -> Result<Vec<String>, ImageError> {
    let out = Command::new(BUSYBOX_BINARY)
        .arg("--list")
        .output()
        .map_err(io_err("busybox --list"))?;
    if !out.status.success() {
        return Err(ImageError::Command {
            command: "busybox --list".into(),
            detail: out.status.to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.contains('/'))
        .map(String::from)
        .collect())
}

fn run(cmd: &mut Command) -> Result<(), ImageError> {
    let command = format!("{cmd:?}");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(io_err(command.clone()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(ImageError::Command {
            command,
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        })
    }
}

/// A file name in `dir` no other thread or process uses: `<base>.<pid>.<n><suffix>`.
fn unique_tmp(dir: &Path, base: &str, suffix: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    dir.join(format!("{base}.{}.{n}{suffix}", std::process::id()))
}

fn hex_sha256(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A content-addressed blob: its bytes and `sha256:<hex>` digest.
struct Blob {
    bytes: Vec<u8>,
    digest: String,
}

impl Blob {
    fn new(bytes: Vec<u8>) -> Self {
        let digest = format!("sha256:{}", hex_sha256(&bytes));
        Blob { bytes, digest }
    }

    fn descriptor(&self, media_type: &str) -> serde_json::Value {
        serde_json::json!({
            "mediaType": media_type,
            "digest": self.digest,
            "size": self.bytes.len(),
        })
    }
}

/// Builds an uncompressed, deterministic tar in memory.
struct LayerBuilder {
    builder: tar::Builder<Vec<u8>>,
}

impl LayerBuilder {
    fn new() -> Self {
        LayerBuilder {
            builder: tar::Builder::new(Vec::new()),
        }
    }

    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut header = tar::Header::new_ustar();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_size(size);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        header
    }

    fn dir(&mut self, path: &str, mode: u32) -> Result<(), ImageError> {
        let mut header = Self::header(tar::EntryType::Directory, mode, 0);
        self.builder
            .append_data(&mut header, format!("{path}/"), io::empty())
            .map_err(io_err(format!("tar {path}")))
    }

    fn file(&mut self, path: &str, mode: u32, data: &[u8]) -> Result<(), ImageError> {
        let mut header = Self::header(tar::EntryType::Regular, mode, data.len() as u64);
        self.builder
            .append_data(&mut header, path, data)
            .map_err(io_err(format!("tar {path}")))
    }

    fn symlink(&mut self, path: &str, target: &str) -> Result<(), ImageError> {
        let mut header = Self::header(tar::EntryType::Symlink, 0o777, 0);
        self.builder
            .append_link(&mut header, path, target)
            .map_err(io_err(format!("tar {path}")))
    }

    fn finish(self) -> Result<Vec<u8>, ImageError> {
        self.builder
            .into_inner()
            .map_err(io_err("finish layer tar"))
    }
}

/// Assembles the OCI layout around one layer and writes it as `dir/file_name` unless an
/// identical tarball is already there.
fn write_image(
    dir: &Path,
    file_name: &str,
    name: &'static str,
    layer: Vec<u8>,
    container_config: serde_json::Value,
) -> Result<LocalImage, ImageError> {
    let layer = Blob::new(layer);
    let config = Blob::new(
        serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "config": container_config,
            // Uncompressed layer: its diff id is its digest.
            "rootfs": { "type": "layers", "diff_ids": [layer.digest] },
        }))
        .map_err(|e| io_err("image config")(e.into()))?,
    );
    let manifest = Blob::new(
        serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": config.descriptor("application/vnd.oci.image.config.v1+json"),
            "layers": [layer.descriptor("application/vnd.oci.image.layer.v1.tar")],
        }))
        .map_err(|e| io_err("image manifest")(e.into()))?,
    );
    let mut manifest_descriptor = manifest.descriptor("application/vnd.oci.image.manifest.v1+json");
    manifest_descriptor["platform"] = serde_json::json!({"architecture": "amd64", "os": "linux"});
    manifest_descriptor["annotations"] = serde_json::json!({
        "io.containerd.image.name": name,
        "org.opencontainers.image.ref.name": name.rsplit(':').next().unwrap_or("latest"),
    });
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "manifests": [manifest_descriptor],
    }))
    .map_err(|e| io_err("image index")(e.into()))?;

    let mut outer = LayerBuilder::new();
    outer.file("oci-layout", 0o644, br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    outer.file("index.json", 0o644, &index)?;
    outer.dir("blobs", 0o755)?;
    outer.dir("blobs/sha256", 0o755)?;
    for blob in [&layer, &config, &manifest] {
        let hex = blob.digest.trim_start_matches("sha256:");
        outer.file(&format!("blobs/sha256/{hex}"), 0o644, &blob.bytes)?;
    }
    let tarball = outer.finish()?;

    std::fs::create_dir_all(dir).map_err(io_err(format!("create {}", dir.display())))?;
    let path = dir.join(file_name);
    let unchanged = std::fs::read(&path)
        .map(|existing| existing == tarball)
        .unwrap_or(false);
    if !unchanged {
        // Written aside and renamed: tests running in parallel never see half a tarball.
        let tmp = unique_tmp(dir, file_name, ".tmp");
        std::fs::write(&tmp, &tarball).map_err(io_err(format!("write {}", tmp.display())))?;
        std::fs::rename(&tmp, &path).map_err(io_err(format!("rename to {}", path.display())))?;
    }
    Ok(LocalImage {
        name,
        tarball: path,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(tarball: &Path) -> Vec<(String, Vec<u8>)> {
        let file = std::fs::File::open(tarball).unwrap();
        let mut archive = tar::Archive::new(file);
        archive
            .entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let path = e.path().unwrap().to_string_lossy().into_owned();
                let mut data = Vec::new();
                io::Read::read_to_end(&mut e, &mut data).unwrap();
                (path, data)
            })
            .collect()
    }

    fn blob<'a>(entries: &'a [(String, Vec<u8>)], digest: &str) -> &'a [u8] {
        let name = format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"));
        let (_, data) = entries.iter().find(|(p, _)| *p == name).unwrap();
        assert_eq!(format!("sha256:{}", hex_sha256(data)), digest);
        data
    }

    /// Walks index -> manifest -> config/layer, checking every digest and size, and returns
    /// the config JSON and the layer's entry names.
    fn check_layout(image: &LocalImage) -> (serde_json::Value, Vec<String>) {
        let entries = entries(&image.tarball);
        let index: serde_json::Value =
            serde_json::from_slice(&entries.iter().find(|(p, _)| p == "index.json").unwrap().1)
                .unwrap();
        let desc = &index["manifests"][0];
        assert_eq!(desc["annotations"]["io.containerd.image.name"], image.name);
        let manifest_bytes = blob(&entries, desc["digest"].as_str().unwrap());
        assert_eq!(desc["size"], manifest_bytes.len());
        let manifest: serde_json::Value = serde_json::from_slice(manifest_bytes).unwrap();
        let config_bytes = blob(&entries, manifest["config"]["digest"].as_str().unwrap());
        let config: serde_json::Value = serde_json::from_slice(config_bytes).unwrap();
        let layer_digest = manifest["layers"][0]["digest"].as_str().unwrap();
        let layer = blob(&entries, layer_digest);
        assert_eq!(manifest["layers"][0]["size"], layer.len());
        assert_eq!(config["rootfs"]["diff_ids"][0], layer_digest);
        let names = tar::Archive::new(layer)
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().to_string_lossy().into_owned())
            .collect();
        (config, names)
    }

    #[test]
    fn busybox_layout_is_consistent_and_reproducible() {
        let dir = tempfile::tempdir().unwrap();
        let image = busybox_image(dir.path()).unwrap();
        let (config, names) = check_layout(&image);
        assert_eq!(config["config"]["Cmd"][0], "sh");
        for name in ["bin/busybox", "bin/sh", "bin/sleep", "bin/uname", "tmp/"] {
            assert!(names.iter().any(|n| n == name), "{name} missing");
        }
        let first = std::fs::read(&image.tarball).unwrap();
        let again = busybox_image(dir.path()).unwrap();
        assert_eq!(std::fs::read(again.tarball).unwrap(), first);
    }

    #[test]
    fn pause_image_runs_and_stops_on_sigterm() {
        let dir = tempfile::tempdir().unwrap();
        let image = pause_image(dir.path()).unwrap();
        let (config, names) = check_layout(&image);
        assert_eq!(config["config"]["Entrypoint"][0], "/pause");
        assert_eq!(names, vec!["pause".to_string()]);
        // The compiled program: waits, then exits 0 on SIGTERM.
        let binary = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| {
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                name.starts_with("pause-") && p.extension().is_none()
            })
            .unwrap();
        let mut child = Command::new(binary).spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(child.try_wait().unwrap().is_none(), "pause exited early");
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "pause ignored SIGTERM"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert_eq!(status.code(), Some(0));
    }
}
