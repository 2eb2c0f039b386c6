//! The `microvm` runtime handler in containerd's config file, added and removed with toml_edit so
//! that everything else in the operator's file (comments, order, formatting, other handlers)
//! stays byte for byte as it was.
//!
//! containerd 1.6 and 1.7 read config version 2 (the CRI plugin `io.containerd.grpc.v1.cri` holds
//! the runtimes); containerd 2.x reads version 3 (`io.containerd.cri.v1.runtime` holds them) and
//! migrates version 2 files in memory, so a version 2 file keeps its format on 2.x too. A file
//! without `version` is version 1, which no containerd we support writes: refused.

use std::path::Path;

use toml_edit::{value, Array, DocumentMut, Item, Table};

/// The handler's name: a RuntimeClass's `handler`.
pub const HANDLER: &str = "microvm";
/// containerd's name for our shim (`containerd-shim-microvm-v1` on its PATH).
pub const RUNTIME_TYPE: &str = "io.containerd.microvm.v1";
/// Pod annotations containerd passes to the shim (the allow-listed ones the shim reads).
pub const POD_ANNOTATIONS: &str = "microvm.io/*";

/// A containerd config file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigVersion {
    /// containerd 1.x (and 2.x, migrated in memory).
    V2,
    /// containerd 2.x.
    V3,
}

impl ConfigVersion {
    /// The number written as `version = N`.
    pub fn number(self) -> i64 {
        match self {
            ConfigVersion::V2 => 2,
            ConfigVersion::V3 => 3,
        }
    }

    /// The plugin whose `containerd.runtimes` table holds the handlers.
    pub fn runtime_plugin(self) -> &'static str {
        match self {
            ConfigVersion::V2 => "io.containerd.grpc.v1.cri",
            ConfigVersion::V3 => "io.containerd.cri.v1.runtime",
        }
    }

    /// The TOML header of our handler's table, as an operator would look for it.
    pub fn handler_header(self) -> String {
        format!(
            "[plugins.\"{}\".containerd.runtimes.{HANDLER}]",
            self.runtime_plugin()
        )
    }
}

/// Why the config cannot be edited; the file is then left untouched.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("not valid TOML: {0}")]
    Parse(#[from] toml_edit::TomlError),
    #[error("config version {0} is not one containerd 1.6 or later reads (2 or 3); write `version = 2` (containerd 1.x) or `version = 3` (containerd 2.x) first")]
    UnsupportedVersion(i64),
    #[error("`version` is not an integer")]
    BadVersion,
    #[error("{0} is not a table")]
    NotATable(String),
}

/// What the handler points the shim at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerSettings {
    /// The shim's config file (`options.ConfigPath`).
    pub config_path: String,
}

/// The file's format; an empty file takes `empty` (the running containerd's native format).
pub fn version_of(doc: &DocumentMut, empty: ConfigVersion) -> Result<ConfigVersion, ConfigError> {
    match doc.get("version") {
        None if doc.is_empty() => Ok(empty),
        None => Err(ConfigError::UnsupportedVersion(1)),
        Some(v) => match v.as_integer() {
            Some(2) => Ok(ConfigVersion::V2),
            Some(3) => Ok(ConfigVersion::V3),
            Some(n) => Err(ConfigError::UnsupportedVersion(n)),
            None => Err(ConfigError::BadVersion),
        },
    }
}

/// `text` with the `microvm` handler added (or its settings updated), and the file's format.
/// An empty `text` becomes a file of `empty`'s format holding only the handler. Running it on its
/// own output changes nothing.
pub fn add_handler(
    text: &str,
    empty: ConfigVersion,
    settings: &HandlerSettings,
) -> Result<(String, ConfigVersion), ConfigError> {
    let mut doc: DocumentMut = text.parse()?;
    let version = version_of(&doc, empty)?;
    if doc.is_empty() {
        doc.insert("version", value(version.number()));
    }
    let runtimes = runtimes_table(&mut doc, version)?;
    let mut handler = match runtimes.remove(HANDLER) {
        Some(Item::Table(t)) => t,
        Some(_) => return Err(ConfigError::NotATable(version.handler_header())),
        None => Table::new(),
    };
    handler.insert("runtime_type", value(RUNTIME_TYPE));
    let mut annotations = Array::new();
    annotations.push(POD_ANNOTATIONS);
    if handler
        .get("pod_annotations")
        .and_then(Item::as_array)
        .is_none_or(|a| a.iter().map(|v| v.as_str()).ne([Some(POD_ANNOTATIONS)]))
    {
        handler.insert("pod_annotations", value(annotations));
    }
    let options = handler
        .entry("options")
        .or_insert_with(|| Item::Table(Table::new()));
    let options = options
        .as_table_mut()
        .ok_or_else(|| ConfigError::NotATable(format!("{}.options", version.handler_header())))?;
    if options.get("ConfigPath").and_then(Item::as_str) != Some(settings.config_path.as_str()) {
        options.insert("ConfigPath", value(settings.config_path.as_str()));
    }
    runtimes.insert(HANDLER, Item::Table(handler));
    Ok((doc.to_string(), version))
}

/// `text` without the `microvm` handler, and the tables that only held it (made implicit when it
/// was added) gone too; `None` if it has no such handler.
pub fn remove_handler(text: &str) -> Result<Option<String>, ConfigError> {
    let mut doc: DocumentMut = text.parse()?;
    let Ok(version) = version_of(&doc, ConfigVersion::V2) else {
        return Ok(None);
    };
    let path = [
        "plugins",
        version.runtime_plugin(),
        "containerd",
        "runtimes",
    ];
    let removed = table_at(doc.as_table_mut(), &path)
        .and_then(|runtimes| runtimes.remove(HANDLER))
        .is_some();
    if !removed {
        return Ok(None);
    }
    prune_empty_implicit(doc.as_table_mut(), &path);
    Ok(Some(doc.to_string()))
}

/// The `containerd.runtimes` table of the runtime plugin, made (as implicit tables, which print no
/// header of their own) where missing.
fn runtimes_table(
    doc: &mut DocumentMut,
    version: ConfigVersion,
) -> Result<&mut Table, ConfigError> {
    let mut table = doc.as_table_mut();
    let mut name = String::from("");
    for key in [
        "plugins",
        version.runtime_plugin(),
        "containerd",
        "runtimes",
    ] {
        name = if name.is_empty() {
            key.to_string()
        } else {
            format!("{name}.\"{key}\"")
        };
        let item = table.entry(key).or_insert_with(|| {
            let mut t = Table::new();
            t.set_implicit(true);
            Item::Table(t)
        });
        table = item
            .as_table_mut()
            .ok_or_else(|| ConfigError::NotATable(name.clone()))?;
    }
    Ok(table)
}

/// The table at `path` below `root`, if every step is a table.
fn table_at<'a>(root: &'a mut Table, path: &[&str]) -> Option<&'a mut Table> {
    match path.split_first() {
        None => Some(root),
        Some((first, rest)) => table_at(root.get_mut(first)?.as_table_mut()?, rest),
    }
}

/// Removes the tables along `path` that are now empty and implicit, deepest first.
fn prune_empty_implicit(root: &mut Table, path: &[&str]) {
    let Some((first, rest)) = path.split_first() else {
        return;
    };
    let Some(child) = root.get_mut(first).and_then(Item::as_table_mut) else {
        return;
    };
    prune_empty_implicit(child, rest);
    if child.is_empty() && child.is_implicit() {
        root.remove(first);
    }
}

/// The containerd line of the binary at `containerd` (`containerd --version`): its native config
/// format. `None` if it cannot be run or read.
pub fn native_version(containerd: &Path) -> Option<ConfigVersion> {
    let out = std::process::Command::new(containerd)
        .arg("--version")
        .output()
        .ok()?;
    native_version_from(&String::from_utf8_lossy(&out.stdout))
}

/// See [`native_version`]: `containerd github.com/containerd/containerd/v2 2.1.9+unknown …`.
pub fn native_version_from(version_output: &str) -> Option<ConfigVersion> {
    let version = version_output.split_whitespace().nth(2)?;
    match version.trim_start_matches('v').split('.').next()? {
        "1" => Some(ConfigVersion::V2),
        "2" => Some(ConfigVersion::V3),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> HandlerSettings {
        HandlerSettings {
            config_path: "/opt/microvm/etc/config.toml".into(),
        }
    }

    const OPERATORS_V2: &str = r#"# The operator's own file: comments, order and spacing must survive.
version = 2
root = "/var/lib/containerd"

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.9"   # pinned
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = true

# Another handler, added by someone else.
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata]
  runtime_type = "io.containerd.kata.v2"
"#;

    const OPERATORS_V3: &str = r#"version = 3

[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = 'runc'

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = 'io.containerd.runc.v2'
"#;

    fn parsed(text: &str) -> toml::Table {
        text.parse().unwrap_or_else(|e| panic!("{e}\n{text}"))
    }

    fn handler<'a>(config: &'a toml::Table, plugin: &str) -> &'a toml::Value {
        &config["plugins"][plugin]["containerd"]["runtimes"][HANDLER]
    }

    #[test]
    fn adds_the_handler_to_an_operators_v2_file_keeping_everything_else() {
        let (text, version) = add_handler(OPERATORS_V2, ConfigVersion::V3, &settings()).unwrap();
        assert_eq!(version, ConfigVersion::V2);
        assert!(
            text.starts_with(OPERATORS_V2),
            "the operator's part changed:\n{text}"
        );
        let config = parsed(&text);
        let h = handler(&config, "io.containerd.grpc.v1.cri");
        assert_eq!(h["runtime_type"].as_str(), Some(RUNTIME_TYPE));
        assert_eq!(h["pod_annotations"][0].as_str(), Some(POD_ANNOTATIONS));
        assert_eq!(
            h["options"]["ConfigPath"].as_str(),
            Some("/opt/microvm/etc/config.toml")
        );
        let runtimes = &config["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"];
        assert_eq!(
            runtimes["runc"]["options"]["SystemdCgroup"].as_bool(),
            Some(true)
        );
        assert_eq!(
            runtimes["kata"]["runtime_type"].as_str(),
            Some("io.containerd.kata.v2")
        );
        assert!(text.contains(&ConfigVersion::V2.handler_header()), "{text}");
    }

    #[test]
    fn adds_the_handler_to_a_v3_file_under_the_runtime_plugin() {
        let (text, version) = add_handler(OPERATORS_V3, ConfigVersion::V2, &settings()).unwrap();
        assert_eq!(version, ConfigVersion::V3);
        assert!(text.starts_with(OPERATORS_V3), "{text}");
        let config = parsed(&text);
        let h = handler(&config, "io.containerd.cri.v1.runtime");
        assert_eq!(h["runtime_type"].as_str(), Some(RUNTIME_TYPE));
    }

    #[test]
    fn an_empty_file_gets_the_running_containerds_format() {
        for version in [ConfigVersion::V2, ConfigVersion::V3] {
            let (text, got) = add_handler("", version, &settings()).unwrap();
            assert_eq!(got, version);
            let config = parsed(&text);
            assert_eq!(config["version"].as_integer(), Some(version.number()));
            assert_eq!(
                handler(&config, version.runtime_plugin())["runtime_type"].as_str(),
                Some(RUNTIME_TYPE)
            );
            // Only the handler's own tables have headers.
            assert_eq!(text.matches('[').count(), 3, "{text}");
        }
    }

    #[test]
    fn adding_twice_changes_nothing_and_updates_a_moved_config_path() {
        let (once, _) = add_handler(OPERATORS_V2, ConfigVersion::V2, &settings()).unwrap();
        let (twice, _) = add_handler(&once, ConfigVersion::V2, &settings()).unwrap();
        assert_eq!(once, twice);
        let moved = HandlerSettings {
            config_path: "/srv/microvm/config.toml".into(),
        };
        let (updated, _) = add_handler(&once, ConfigVersion::V2, &moved).unwrap();
        let config = parsed(&updated);
        assert_eq!(
            handler(&config, "io.containerd.grpc.v1.cri")["options"]["ConfigPath"].as_str(),
            Some("/srv/microvm/config.toml")
        );
        assert_eq!(
            updated
                .matches("[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.microvm]")
                .count(),
            1
        );
    }

    #[test]
    fn removing_gives_back_the_file_as_it_was() {
        let trailing = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n  runtime_type = \"x\"\n# a last comment\n";
        for original in [
            OPERATORS_V2,
            OPERATORS_V3,
            "version = 2\n",
            "version = 3\n",
            trailing,
        ] {
            let (added, _) = add_handler(original, ConfigVersion::V2, &settings()).unwrap();
            let removed = remove_handler(&added)
                .unwrap()
                .expect("the handler is there");
            assert_eq!(removed, original, "after adding:\n{added}");
        }
        assert_eq!(remove_handler(OPERATORS_V2).unwrap(), None);
    }

    #[test]
    fn refuses_version_1_and_non_toml_leaving_the_text_alone() {
        let err = add_handler("root = \"/x\"\n", ConfigVersion::V2, &settings()).unwrap_err();
        assert!(err.to_string().contains("version 1"), "{err}");
        assert!(matches!(
            add_handler("version = 2\n[plugins\n", ConfigVersion::V2, &settings()),
            Err(ConfigError::Parse(_))
        ));
        assert!(matches!(
            add_handler("version = 4\n", ConfigVersion::V2, &settings()),
            Err(ConfigError::UnsupportedVersion(4))
        ));
    }

    #[test]
    fn a_plugins_key_that_is_not_a_table_is_an_error_naming_it() {
        let err =
            add_handler("version = 2\nplugins = 3\n", ConfigVersion::V2, &settings()).unwrap_err();
        assert!(err.to_string().contains("plugins"), "{err}");
    }

    #[test]
    fn the_native_format_follows_the_containerd_line() {
        assert_eq!(
            native_version_from(
                "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+b1"
            ),
            Some(ConfigVersion::V2)
        );
        assert_eq!(
            native_version_from("containerd github.com/containerd/containerd/v2 2.1.9+unknown "),
            Some(ConfigVersion::V3)
        );
        assert_eq!(native_version_from("nonsense"), None);
    }
}
