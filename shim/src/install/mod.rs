//! `microvm install` / `microvm uninstall`: microvm on a node (docs/install.md).
//!
//! Install runs check-host first: its verdict picks the backend written into the installed
//! config (the embedded VMM where the guest kernel boots under this host's KVM, else the QEMU
//! backend, which then needs QEMU, vhost-device-vsock and virtiofsd), and a host that can run neither is
//! refused before anything changes. Then, in order:
//!
//! 1. the shim, the `microvm` tool (and vhost-device-vsock and virtiofsd for the QEMU backend) into
//!    `<prefix>/bin`, the guest kernel and initrd into `<prefix>/share`;
//! 2. `<prefix>/etc/config.toml`, only if there is none (an operator's edits are kept);
//! 3. a link `containerd-shim-microvm-v1` in a folder on containerd's PATH (`/usr/local/bin`);
//! 4. the `microvm` handler in containerd's config ([`containerd_config`]).
//!
//! Each step is recorded in `<prefix>/install.json` as it is done, with containerd's config as it
//! was before; a failed step undoes the ones before it. Uninstall undoes exactly what the record
//! says: containerd's config is put back byte for byte when nobody changed it since (else only
//! our handler is taken out of it), files are removed only where they are still ours.
//! Installing again is harmless: it updates the files and leaves the record of the first install.
//!
//! One file of about 650 lines: install's steps and their undo share the record and its writes;
//! split, each half would import the other (`containerd_config` is apart: it is pure TOML).

pub mod containerd_config;

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{Config, Hypervisor};
use crate::host_check::{self, HostReport};
use crate::vm::{choose_backend, Backend};
use containerd_config::{ConfigVersion, HandlerSettings};

/// The shim's binary name (containerd derives it from the runtime type).
pub const SHIM_BINARY: &str = "containerd-shim-microvm-v1";
/// The record of an install, in the prefix.
pub const RECORD_NAME: &str = "install.json";

/// What `microvm install` is asked to do.
#[derive(Debug, Clone)]
pub struct InstallOptions {
    /// Where microvm's files go (`/opt/microvm`).
    pub prefix: PathBuf,
    /// containerd's config file (`/etc/containerd/config.toml`; created if missing).
    pub containerd_config: PathBuf,
    /// The containerd binary whose version decides the format of a new config file.
    pub containerd: PathBuf,
    /// A folder on containerd's PATH where the shim is linked (`/usr/local/bin`).
    pub shim_link_dir: PathBuf,
    /// Where the binaries to install are (the folder of the running `microvm`).
    pub bin_source: PathBuf,
    /// The guest kernel and initrd to install.
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// vhost-device-vsock, installed when the QEMU backend is chosen.
    pub vhost_vsock: PathBuf,
    /// The Rust virtiofsd, installed when the QEMU backend is chosen.
    pub virtiofsd: PathBuf,
    /// The QEMU binary the QEMU backend runs (checked, not installed: Debian's package).
    pub qemu: PathBuf,
    /// Print what would change (with the config diff) and change nothing.
    pub dry_run: bool,
    /// Install on a host where pods can only run under QEMU's software emulation (TCG),
    /// writing `allow_software_emulation = true` into the config; without it such a host is
    /// refused with check-host's reason.
    pub allow_software_emulation: bool,
}

/// Why install or uninstall stopped. Nothing is left half done: see the module doc.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("this host cannot run microvm pods: {0}")]
    HostCannotRun(String),
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("containerd config {}: {source}", path.display())]
    ContainerdConfig {
        path: PathBuf,
        #[source]
        source: containerd_config::ConfigError,
    },
    #[error(transparent)]
    RecordFile(#[from] crate::state::RecordError),
    #[error("the install record {}: {reason}", path.display())]
    Record { path: PathBuf, reason: String },
    #[error("{} is not ours (not a link to {}): left alone; remove it or pick another --shim-link-dir", link.display(), target.display())]
    ForeignShimLink { link: PathBuf, target: PathBuf },
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> InstallError {
    let path = path.to_path_buf();
    move |source| InstallError::Io { what, path, source }
}

/// What an install did, step by step: the record uninstall works from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstallRecord {
    /// Files this install created (not ones that were there before and were replaced).
    pub files: Vec<PathBuf>,
    /// Folders it created, parents first.
    pub dirs: Vec<PathBuf>,
    /// The shim link it made.
    pub shim_link: Option<PathBuf>,
    /// containerd's config: its path, its text before (none: there was no file), and after.
    pub containerd_config: Option<ConfigEdit>,
}

/// The one edit of containerd's config.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigEdit {
    pub path: PathBuf,
    pub before: Option<String>,
    pub after: String,
}

/// One thing install does.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Dir(PathBuf),
    Copy { from: PathBuf, to: PathBuf },
    Write { path: PathBuf, text: String },
    Link { link: PathBuf, target: PathBuf },
    ContainerdConfig(ConfigEdit),
}

/// What install printed: the backend it chose and why, the steps, what to restart.
#[derive(Debug, Clone)]
pub struct InstallReport {
    pub lines: Vec<String>,
}

/// The backend check-host's verdict picks (`vm::choose_backend` for `auto`), whether it
/// is software emulation, or why this host cannot run pods at all.
fn choose(
    report: &HostReport,
    opts: &InstallOptions,
) -> Result<(Hypervisor, String, bool), InstallError> {
    let choice =
        choose_backend(report, Hypervisor::Auto, opts.allow_software_emulation).map_err(|e| {
            InstallError::HostCannotRun(format!(
                "{e}; `microvm install --allow-software-emulation` installs it so"
            ))
        })?;
    if choice.backend == Backend::Kvm {
        return Ok((
            Hypervisor::Kvm,
            format!(
                "embedded VMM: kvm {} boots the guest kernel",
                report.kvm_kind
            ),
            false,
        ));
    }
    let why_not_kvm = &choice.reason;
    // A path is taken as it is, a bare name looked up on PATH; either must be executable.
    let qemu = which::which(&opts.qemu).ok();
    let mut missing = Vec::new();
    if qemu.is_none() {
        missing.push(format!("QEMU ({} not found)", opts.qemu.display()));
    }
    if !opts.vhost_vsock.is_file() {
        missing.push(format!(
            "vhost-device-vsock ({} not found: scripts/install-vhost-device-vsock.sh)",
            opts.vhost_vsock.display()
        ));
    }
    if !opts.virtiofsd.is_file() {
        missing.push(format!(
            "virtiofsd ({} not found: scripts/install-virtiofsd.sh)",
            opts.virtiofsd.display()
        ));
    }
    if !missing.is_empty() {
        return Err(InstallError::HostCannotRun(format!(
            "the embedded VMM cannot boot the guest here ({why_not_kvm}) and the QEMU backend lacks {}",
            missing.join(" and ")
        )));
    }
    let how = if choice.software_emulation() {
        "on software emulation (TCG), allowed by --allow-software-emulation"
    } else {
        "on KVM"
    };
    Ok((
        Hypervisor::Qemu,
        format!("QEMU backend {how}: the embedded VMM cannot boot the guest here: {why_not_kvm}"),
        choice.software_emulation(),
    ))
}

/// The installed config's text.
fn config_text(
    hypervisor: Hypervisor,
    software_emulation: bool,
    why: &str,
    kernel: &Path,
    initrd: &Path,
    qemu_helpers: Option<(&Path, &Path)>,
) -> String {
    let name = match hypervisor {
        Hypervisor::Kvm => "kvm",
        Hypervisor::Qemu => "qemu",
        Hypervisor::Auto => "auto",
    };
    let mut text = format!(
        "# microvm's config (keys: docs/operators.md), written by `microvm install`.\n\
         # check-host chose the backend: {why}\n\
         hypervisor = \"{name}\"\n\
         kernel = {}\n\
         initrd = {}\n",
        toml_string(kernel),
        toml_string(initrd)
    );
    if software_emulation {
        text.push_str(
            "# TCG is no security boundary; each pod on it logs a warning \
             (docs/qemu-backend.md).\nallow_software_emulation = true\n",
        );
    }
    if let Some((vsock, virtiofsd)) = qemu_helpers {
        text.push_str(&format!(
            "\n[qemu]\nvhost_vsock_binary = {}\nvirtiofsd_binary = {}\n",
            toml_string(vsock),
            toml_string(virtiofsd)
        ));
    }
    text
}

fn toml_string(p: &Path) -> String {
    toml::Value::String(p.to_string_lossy().into_owned()).to_string()
}

/// Installs microvm (see the module doc); with `dry_run`, only says what it would do.
pub fn install(opts: &InstallOptions, report: &HostReport) -> Result<InstallReport, InstallError> {
    let (hypervisor, why, software_emulation) = choose(report, opts)?;
    let bin = opts.prefix.join("bin");
    let share = opts.prefix.join("share");
    let etc = opts.prefix.join("etc");
    let config_path = etc.join("config.toml");
    let mut steps = Vec::new();
    for dir in [&opts.prefix, &bin, &share, &etc] {
        steps.push(Step::Dir(dir.clone()));
    }
    for name in [SHIM_BINARY, "microvm"] {
        steps.push(Step::Copy {
            from: opts.bin_source.join(name),
            to: bin.join(name),
        });
    }
    let installed_helpers = (hypervisor == Hypervisor::Qemu)
        .then(|| (bin.join("vhost-device-vsock"), bin.join("virtiofsd")));
    if let Some((vsock, virtiofsd)) = &installed_helpers {
        steps.push(Step::Copy {
            from: opts.vhost_vsock.clone(),
            to: vsock.clone(),
        });
        steps.push(Step::Copy {
            from: opts.virtiofsd.clone(),
            to: virtiofsd.clone(),
        });
    }
    let kernel = share.join("vmlinux");
    let initrd = share.join("initrd.cpio");
    steps.push(Step::Copy {
        from: opts.kernel.clone(),
        to: kernel.clone(),
    });
    steps.push(Step::Copy {
        from: opts.initrd.clone(),
        to: initrd.clone(),
    });
    let mut lines = vec![format!("backend: {why}")];
    if config_path.exists() {
        lines.push(format!(
            "{}: kept as it is (an existing config is never overwritten)",
            config_path.display()
        ));
    } else {
        let text = config_text(
            hypervisor,
            software_emulation,
            &why,
            &kernel,
            &initrd,
            installed_helpers
                .as_ref()
                .map(|(vsock, virtiofsd)| (vsock.as_path(), virtiofsd.as_path())),
        );
        Config::parse(&text).map_err(|e| InstallError::Record {
            path: config_path.clone(),
            reason: format!("the config install writes does not load: {e}"),
        })?;
        steps.push(Step::Write {
            path: config_path.clone(),
            text,
        });
    }
    steps.push(Step::Dir(opts.shim_link_dir.clone()));
    steps.push(Step::Link {
        link: opts.shim_link_dir.join(SHIM_BINARY),
        target: bin.join(SHIM_BINARY),
    });
    let before = match fs::read_to_string(&opts.containerd_config) {
        Ok(t) => Some(t),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => {
            return Err(io_err(
                "reading containerd's config",
                &opts.containerd_config,
            )(e))
        }
    };
    let native = containerd_config::native_version(&opts.containerd).unwrap_or(ConfigVersion::V2);
    let (after, version) = containerd_config::add_handler(
        before.as_deref().unwrap_or(""),
        native,
        &HandlerSettings {
            config_path: config_path.to_string_lossy().into_owned(),
        },
    )
    .map_err(|source| InstallError::ContainerdConfig {
        path: opts.containerd_config.clone(),
        source,
    })?;
    if let Some(parent) = opts.containerd_config.parent() {
        steps.push(Step::Dir(parent.to_path_buf()));
    }
    let config_changes = before.as_deref() != Some(after.as_str());
    if config_changes {
        lines.push(format!(
            "{} (config version {}): the `microvm` handler, {}",
            opts.containerd_config.display(),
            version.number(),
            version.handler_header()
        ));
        lines.push(unified_diff(
            before.as_deref().unwrap_or(""),
            &after,
            &opts.containerd_config,
        ));
        steps.push(Step::ContainerdConfig(ConfigEdit {
            path: opts.containerd_config.clone(),
            before: before.clone(),
            after,
        }));
    } else {
        lines.push(format!(
            "{}: already has the `microvm` handler",
            opts.containerd_config.display()
        ));
    }

    if opts.dry_run {
        lines.insert(0, "dry run: nothing is changed".to_string());
        for step in &steps {
            lines.push(format!("would {}", describe(step)));
        }
        return Ok(InstallReport { lines });
    }

    let record_path = opts.prefix.join(RECORD_NAME);
    let previous = read_record(&record_path)?;
    // A second install keeps the first one's record of what was there before.
    let full = |record: &InstallRecord| match &previous {
        Some(first) => merge(first.clone(), record.clone()),
        None => record.clone(),
    };
    let mut record = InstallRecord::default();
    for step in &steps {
        // Each step is recorded as soon as it is done (the prefix is the first step).
        let done =
            apply(step, &mut record).and_then(|()| write_record(&record_path, &full(&record)));
        if let Err(e) = done {
            let undone = undo(&record);
            if previous.is_none() {
                let _ = fs::remove_file(&record_path);
                undo_dirs(&record);
            }
            return Err(match undone {
                Ok(()) => e,
                Err(u) => InstallError::Record {
                    path: record_path,
                    reason: format!("{e}; undoing the steps before it failed too: {u}"),
                },
            });
        }
        lines.push(describe(step));
    }
    lines.push(format!("recorded in {}", record_path.display()));
    if config_changes {
        lines.push("restart containerd to load the handler: systemctl restart containerd".into());
    }
    lines.push(
        "pods select it with a RuntimeClass whose handler is `microvm` (deploy/runtimeclass.yaml)"
            .into(),
    );
    Ok(InstallReport { lines })
}

fn describe(step: &Step) -> String {
    match step {
        Step::Dir(d) => format!("make folder {}", d.display()),
        Step::Copy { from, to } => format!("install {} as {}", from.display(), to.display()),
        Step::Write { path, .. } => format!("write {}", path.display()),
        Step::Link { link, target } => format!("link {} -> {}", link.display(), target.display()),
        Step::ContainerdConfig(edit) => {
            format!("add the `microvm` handler to {}", edit.path.display())
        }
    }
}

/// Does `step`, recording what it created.
fn apply(step: &Step, record: &mut InstallRecord) -> Result<(), InstallError> {
    match step {
        Step::Dir(dir) => {
            // Record each folder made, outermost first, so uninstall removes innermost first.
            let mut missing: Vec<&Path> = dir.ancestors().take_while(|a| !a.exists()).collect();
            missing.reverse();
            for d in missing {
                fs::create_dir(d).map_err(io_err("making the folder", d))?;
                record.dirs.push(d.to_path_buf());
            }
        }
        Step::Copy { from, to } => {
            let existed = to.exists();
            // Copy beside, then rename: a running shim keeps its old binary.
            let tmp = to.with_extension("microvm-new");
            fs::copy(from, &tmp).map_err(io_err("copying", from))?;
            let mode = fs::metadata(from)
                .map_err(io_err("reading", from))?
                .permissions()
                .mode();
            fs::set_permissions(&tmp, fs::Permissions::from_mode(mode & 0o755))
                .map_err(io_err("setting the mode of", &tmp))?;
            fs::rename(&tmp, to).map_err(io_err("installing", to))?;
            if !existed {
                record.files.push(to.clone());
            }
        }
        Step::Write { path, text } => {
            fs::write(path, text).map_err(io_err("writing", path))?;
            record.files.push(path.clone());
        }
        Step::Link { link, target } => match fs::read_link(link) {
            Ok(t) if t == *target => {}
            Ok(_) | Err(_) if link.symlink_metadata().is_ok() => {
                return Err(InstallError::ForeignShimLink {
                    link: link.clone(),
                    target: target.clone(),
                })
            }
            _ => {
                std::os::unix::fs::symlink(target, link).map_err(io_err("linking", link))?;
                record.shim_link = Some(link.clone());
            }
        },
        Step::ContainerdConfig(edit) => {
            write_atomically(&edit.path, &edit.after)?;
            record.containerd_config = Some(edit.clone());
        }
    }
    Ok(())
}

/// Writes `text` to `path` through a file beside it and a rename, keeping the old file's mode.
fn write_atomically(path: &Path, text: &str) -> Result<(), InstallError> {
    let tmp = path.with_extension("microvm-new");
    fs::write(&tmp, text).map_err(io_err("writing", &tmp))?;
    if let Ok(meta) = fs::metadata(path) {
        fs::set_permissions(&tmp, meta.permissions())
            .map_err(io_err("setting the mode of", &tmp))?;
    }
    fs::rename(&tmp, path).map_err(io_err("replacing", path))
}

/// A later install's record added to the first one's: what was there before the first stays.
fn merge(first: InstallRecord, later: InstallRecord) -> InstallRecord {
    let mut out = first;
    for f in later.files {
        if !out.files.contains(&f) {
            out.files.push(f);
        }
    }
    for d in later.dirs {
        if !out.dirs.contains(&d) {
            out.dirs.push(d);
        }
    }
    out.shim_link = out.shim_link.or(later.shim_link);
    out.containerd_config = match (out.containerd_config, later.containerd_config) {
        (Some(first), Some(later)) => Some(ConfigEdit {
            after: later.after,
            ..first
        }),
        (a, b) => a.or(b),
    };
    out
}

fn read_record(path: &Path) -> Result<Option<InstallRecord>, InstallError> {
    Ok(crate::state::read_record(path)?)
}

fn write_record(path: &Path, record: &InstallRecord) -> Result<(), InstallError> {
    Ok(crate::state::write_record(path, record)?)
}

/// Undoes `record`: containerd's config, the link, the files, the folders (innermost first).
fn undo(record: &InstallRecord) -> Result<(), String> {
    let mut errors = Vec::new();
    if let Some(edit) = &record.containerd_config {
        if let Err(e) = restore_containerd_config(edit) {
            errors.push(e);
        }
    }
    if let Some(link) = &record.shim_link {
        if let Err(e) = fs::remove_file(link) {
            if e.kind() != io::ErrorKind::NotFound {
                errors.push(format!("{}: {e}", link.display()));
            }
        }
    }
    for f in &record.files {
        if let Err(e) = fs::remove_file(f) {
            if e.kind() != io::ErrorKind::NotFound {
                errors.push(format!("{}: {e}", f.display()));
            }
        }
    }
    undo_dirs(record);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// Removes the folders `record` made, innermost first, each only if empty (whatever else is in
/// one is not ours).
fn undo_dirs(record: &InstallRecord) {
    for d in record.dirs.iter().rev() {
        let _ = fs::remove_dir(d);
    }
}

/// containerd's config as it was before the install if nobody changed it since; else only our
/// handler taken out. Returns what it did.
fn restore_containerd_config(edit: &ConfigEdit) -> Result<String, String> {
    let now = match fs::read_to_string(&edit.path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Ok(format!("{}: gone already", edit.path.display()))
        }
        Err(e) => return Err(format!("{}: {e}", edit.path.display())),
    };
    if now == edit.after {
        match &edit.before {
            Some(before) => write_atomically(&edit.path, before).map_err(|e| e.to_string())?,
            None => {
                fs::remove_file(&edit.path).map_err(|e| format!("{}: {e}", edit.path.display()))?
            }
        }
        return Ok(format!(
            "{}: restored as it was before the install",
            edit.path.display()
        ));
    }
    match containerd_config::remove_handler(&now)
        .map_err(|e| format!("{}: {e}", edit.path.display()))?
    {
        Some(text) => {
            write_atomically(&edit.path, &text).map_err(|e| e.to_string())?;
            Ok(format!(
                "{}: changed since the install; only the `microvm` handler was taken out",
                edit.path.display()
            ))
        }
        None => Ok(format!("{}: has no `microvm` handler", edit.path.display())),
    }
}

/// Uninstalls what `<prefix>/install.json` records; says what it did.
pub fn uninstall(prefix: &Path, dry_run: bool) -> Result<Vec<String>, InstallError> {
    let record_path = prefix.join(RECORD_NAME);
    let record = read_record(&record_path)?.ok_or_else(|| InstallError::Record {
        path: record_path.clone(),
        reason: "missing: nothing was installed under this prefix (or it was removed by hand)"
            .into(),
    })?;
    let mut lines = Vec::new();
    if dry_run {
        lines.push("dry run: nothing is changed".into());
        if let Some(edit) = &record.containerd_config {
            lines.push(format!("would restore {}", edit.path.display()));
        }
        for f in record.files.iter().chain(record.shim_link.iter()) {
            lines.push(format!("would remove {}", f.display()));
        }
        return Ok(lines);
    }
    if let Some(edit) = &record.containerd_config {
        lines.push(
            restore_containerd_config(edit).map_err(|reason| InstallError::Record {
                path: record_path.clone(),
                reason,
            })?,
        );
    }
    let rest = InstallRecord {
        containerd_config: None,
        ..record.clone()
    };
    // The record goes before the folders, so the prefix can go too.
    fs::remove_file(&record_path).map_err(io_err("removing", &record_path))?;
    undo(&rest).map_err(|reason| InstallError::Record {
        path: record_path.clone(),
        reason,
    })?;
    lines.push(format!(
        "removed {} files, the shim link and the folders install made",
        rest.files.len()
    ));
    if record.containerd_config.is_some() {
        lines.push("restart containerd to drop the handler: systemctl restart containerd".into());
    }
    Ok(lines)
}

/// A unified diff of `before` -> `after`, for --dry-run.
fn unified_diff(before: &str, after: &str, path: &Path) -> String {
    let name = path.display().to_string();
    similar::TextDiff::from_lines(before, after)
        .unified_diff()
        .header(&name, &name)
        .to_string()
}

/// check-host's report for the kernel being installed.
pub fn host_report(kernel: &Path) -> HostReport {
    host_check::probe(Some(kernel))
}
