//! The files in deploy/ as an operator would ship them: the systemd units pass `systemd-analyze verify` (and a
//! hardening score), the Kubernetes manifests parse and agree with the binary (env names, args, ports, probe
//! paths, grace period vs drain timeout, shard range), the alert rules are valid PromQL and pass their
//! `promtool test rules` unit tests, the dashboard's queries are valid PromQL, and what a running replica's
//! `/metrics` serves passes `promtool check metrics`.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::Duration,
};

use serde_json::Value;
use sqlx::PgPool;

use crate::{
    daemon::http_get,
    helpers::{daemon, database_url, due_now, free_port, insert, loan, stop, wait_until},
};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every document of a YAML file, as JSON values.
fn yaml_docs(rel: &str) -> Vec<Value> {
    let text = read(rel);
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| serde::Deserialize::deserialize(doc).unwrap_or_else(|e| panic!("{rel} is not YAML: {e}")))
        .collect()
}

fn the<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let mut found = docs.iter().filter(|d| d["kind"] == kind);
    let doc = found.next().unwrap_or_else(|| panic!("no {kind}"));
    assert!(found.next().is_none(), "more than one {kind}");
    doc
}

fn duration(s: &str) -> Duration {
    humantime::parse_duration(s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
}

/// `fine-settler --config FILE check-config` with exactly `env` (plus a dummy database URL).
fn check_config(config: &Path, env: &[(&str, String)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fine-settler"));
    cmd.env_clear()
        .env(
            "DATABASE_URL",
            "postgres://fine_settler:hunter2@db.invalid/libraryd",
        )
        .arg("--config")
        .arg(config)
        .arg("check-config")
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run fine-settler")
}

fn assert_exit(out: &Output, code: i32, what: &str) {
    assert_eq!(
        out.status.code(),
        Some(code),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The container's env as name -> the whole entry.
fn env_of(container: &Value) -> BTreeMap<String, Value> {
    container["env"]
        .as_array()
        .expect("env")
        .iter()
        .map(|e| (e["name"].as_str().expect("env name").to_string(), e.clone()))
        .collect()
}

fn labels_match(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .expect("selector")
        .iter()
        .all(|(k, v)| &labels[k] == v)
}

/// A Secret of secret.example.yaml's key names.
fn secret_keys(secrets: &[Value], name: &str) -> Vec<String> {
    let s = secrets
        .iter()
        .find(|s| s["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("secret.example.yaml has no Secret {name}"));
    s["stringData"]
        .as_object()
        .expect("stringData")
        .keys()
        .cloned()
        .collect()
}

/// Whether the `secretKeyRef` of an env entry names a key of an example Secret.
fn refers_to_a_secret(secrets: &[Value], entry: &Value) -> bool {
    let r = &entry["valueFrom"]["secretKeyRef"];
    secret_keys(secrets, r["name"].as_str().expect("secret"))
        .contains(&r["key"].as_str().expect("key").into())
}

/// A container's args, as strings.
fn args_of(container: &Value) -> Vec<&str> {
    container["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("arg"))
        .collect()
}

/// The config file the container names with `--config` (its name and text), found in the ConfigMap mounted there.
fn mounted_config(docs: &[Value], pod: &Value, c: &Value) -> (String, String) {
    let args = args_of(c);
    assert_eq!(args.len(), 3);
    assert_eq!((args[0], args[2]), ("--config", "run"));
    let config_path = Path::new(args[1]);
    let mount = c["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .find(|m| config_path.parent() == Some(Path::new(m["mountPath"].as_str().expect("path"))))
        .expect("the config file's directory is mounted");
    let volume = pod["spec"]["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("volume");
    let cm = the(docs, "ConfigMap");
    assert_eq!(volume["configMap"]["name"], cm["metadata"]["name"]);
    let file_name = config_path.file_name().expect("file").to_str().expect("utf-8");
    let toml_text = cm["data"][file_name]
        .as_str()
        .expect("the ConfigMap holds the config file");
    (file_name.to_string(), toml_text.to_string())
}

/// Ports and probes: the container port is the one http.listen binds; probe paths are the binary's.
fn ports_and_probes_agree(pod: &Value, c: &Value, toml: &toml::Value) {
    let listen = toml["http"]["listen"].as_str().expect("http.listen");
    let port: i64 = listen
        .rsplit_once(':')
        .expect("host:port")
        .1
        .parse()
        .expect("port");
    let ports = c["ports"].as_array().expect("ports");
    let metrics = ports
        .iter()
        .find(|p| p["name"] == "metrics")
        .expect("metrics port");
    assert_eq!(metrics["containerPort"].as_i64(), Some(port));
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(c[probe]["httpGet"]["port"], "metrics", "{probe}");
    }
    assert_eq!(
        pod["metadata"]["annotations"]["prometheus.io/port"].as_str(),
        Some(port.to_string().as_str())
    );
}

/// SIGTERM drains within schedule.drain_timeout: the grace period must be longer. The liveness probe gives up
/// later than /healthz's own window (two periods + batch timeout, >= 1 min).
fn grace_and_liveness_agree(pod: &Value, c: &Value, toml: &toml::Value) {
    let drain = duration(toml["schedule"]["drain_timeout"].as_str().unwrap_or("30s"));
    let grace = pod["spec"]["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("grace period");
    assert!(
        Duration::from_secs(grace) > drain,
        "grace {grace}s <= drain {drain:?}"
    );
    let live = &c["livenessProbe"];
    let give_up =
        live["periodSeconds"].as_u64().unwrap_or(10) * live["failureThreshold"].as_u64().unwrap_or(3);
    assert!(give_up >= 60, "liveness gives up after {give_up}s");
}

/// Non-root, read-only, no privileges; the image's user is the one the pod runs as.
fn pod_is_locked_down(pod: &Value, c: &Value) {
    let psc = &pod["spec"]["securityContext"];
    assert_eq!(psc["runAsNonRoot"], true);
    let uid = psc["runAsUser"].as_i64().expect("runAsUser");
    assert!(read("Dockerfile").contains(&format!("USER {uid}:{uid}")));
    let csc = &c["securityContext"];
    assert_eq!(csc["allowPrivilegeEscalation"], false);
    assert_eq!(csc["readOnlyRootFilesystem"], true);
    assert_eq!(csc["capabilities"]["drop"][0], "ALL");
    assert!(c["resources"]["requests"]["memory"].is_string());
    assert!(c["resources"]["limits"]["memory"].is_string());
}

/// The Service and the PodDisruptionBudget select the replicas, and keep them scrapable and drainable when unready.
fn service_and_budget_select_the_replicas(docs: &[Value], sts: &Value, replicas: i64) {
    let pod_labels = &sts["spec"]["template"]["metadata"]["labels"];
    let svc = the(docs, "Service");
    assert_eq!(svc["spec"]["clusterIP"], "None");
    assert_eq!(sts["spec"]["serviceName"], svc["metadata"]["name"]);
    assert!(labels_match(&svc["spec"]["selector"], pod_labels));
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "metrics");
    // Metrics stay discoverable and drains stay possible while a database outage makes every pod unready.
    assert_eq!(svc["spec"]["publishNotReadyAddresses"], true);
    let pdb = the(docs, "PodDisruptionBudget");
    assert_eq!(pdb["spec"]["unhealthyPodEvictionPolicy"], "AlwaysAllow");
    assert!(labels_match(&pdb["spec"]["selector"]["matchLabels"], pod_labels));
    assert!(pdb["spec"]["maxUnavailable"]
        .as_i64()
        .is_some_and(|m| m >= 1 && m < replicas.max(2)));
}

/// The migration Job: same config file (`config_arg`, written at `config`), its own (owner) secret, a config that
/// validates without a pod index.
fn migration_job_agrees(docs: &[Value], secrets: &[Value], config_arg: &str, config: &Path) {
    let job = the(docs, "Job");
    let jc = &job["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(args_of(jc), ["--config", config_arg, "migrate"]);
    let jenv = env_of(jc);
    assert!(refers_to_a_secret(secrets, &jenv["DATABASE_URL"]));
    let job_env: Vec<(&str, String)> = jenv
        .iter()
        .filter_map(|(k, v)| v["value"].as_str().map(|v| (k.as_str(), v.to_string())))
        .collect();
    assert_exit(&check_config(config, &job_env), 0, "the migration Job's config");
    assert_eq!(
        job["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"],
        true
    );
}

#[test]
fn kubernetes_manifests_agree_with_the_binary() {
    let kustomization = &yaml_docs("deploy/k8s/kustomization.yaml")[0];
    let mut docs = Vec::new();
    for r in kustomization["resources"].as_array().expect("resources") {
        docs.extend(yaml_docs(&format!("deploy/k8s/{}", r.as_str().expect("path"))));
    }
    let secrets = yaml_docs("deploy/k8s/secret.example.yaml");

    let sts = the(&docs, "StatefulSet");
    let replicas = sts["spec"]["replicas"].as_i64().expect("replicas");
    let pod = &sts["spec"]["template"];
    assert!(labels_match(
        &sts["spec"]["selector"]["matchLabels"],
        &pod["metadata"]["labels"]
    ));
    let c = &pod["spec"]["containers"][0];
    let env = env_of(c);

    // Shards = replicas; the shard is the pod index label.
    assert_eq!(
        env["FINE_SETTLER__INSTANCE__SHARDS"]["value"].as_str(),
        Some(replicas.to_string().as_str()),
        "FINE_SETTLER__INSTANCE__SHARDS must equal spec.replicas"
    );
    assert_eq!(
        env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.labels['apps.kubernetes.io/pod-index']"
    );
    assert!(refers_to_a_secret(&secrets, &env["DATABASE_URL"]));

    // The config file: args name it, the volume mounts the ConfigMap that holds it.
    let (file_name, toml_text) = mounted_config(&docs, pod, c);
    let toml: toml::Value = toml::from_str(&toml_text).expect("the ConfigMap's TOML parses");
    assert_eq!(toml["instance"]["shard_from"].as_str(), Some("pod-index"));
    let index_env = toml["instance"]["pod_index_env"].as_str().unwrap_or("POD_INDEX");
    assert!(env.contains_key(index_env));

    // Every pod index is a valid shard with this config and env; the next one is refused (exit 2).
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join(&file_name);
    std::fs::write(&config, &toml_text).expect("write config");
    let shards = ("FINE_SETTLER__INSTANCE__SHARDS", replicas.to_string());
    for index in 0..replicas {
        let out = check_config(&config, &[shards.clone(), (index_env, index.to_string())]);
        assert_exit(&out, 0, &format!("pod index {index}"));
        assert!(!String::from_utf8_lossy(&out.stdout).contains("hunter2"));
        // It prints the shard the pod will run, resolved from its index.
        let shown: toml::Value = toml::from_str(&String::from_utf8_lossy(&out.stdout)).expect("TOML");
        assert_eq!(
            shown["instance"]["shard"].as_integer(),
            Some(index),
            "pod index {index}"
        );
    }
    let out = check_config(&config, &[shards.clone(), (index_env, replicas.to_string())]);
    assert_exit(&out, 2, "a pod index past the shard count");
    assert!(String::from_utf8_lossy(&out.stderr).contains("instance.shard"));

    ports_and_probes_agree(pod, c, &toml);
    grace_and_liveness_agree(pod, c, &toml);
    pod_is_locked_down(pod, c);
    service_and_budget_select_the_replicas(&docs, sts, replicas);
    migration_job_agrees(&docs, &secrets, args_of(c)[1], &config);
}

/// A throwaway root for `systemd-analyze --root`: the distribution's units, ours, and the binary where
/// ExecStart expects it.
fn systemd_root() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let r = dir.path();
    for sub in ["usr/local/bin", "etc/systemd/system", "usr/lib/systemd"] {
        std::fs::create_dir_all(r.join(sub)).expect("mkdir");
    }
    std::fs::copy(
        env!("CARGO_BIN_EXE_fine-settler"),
        r.join("usr/local/bin/fine-settler"),
    )
    .expect("binary");
    let copied = Command::new("cp")
        .args(["-r", "/usr/lib/systemd/system"])
        .arg(r.join("usr/lib/systemd/"))
        .status()
        .expect("cp");
    assert!(copied.success());
    for unit in [
        "fine-settler@.service",
        "fine-settler-migrate.service",
        "fine-settler.target",
    ] {
        std::fs::copy(
            root().join("deploy/systemd").join(unit),
            r.join("etc/systemd/system").join(unit),
        )
        .expect("unit");
    }
    dir
}

fn systemd_analyze(root: &Path, args: &[&str]) -> Output {
    Command::new("systemd-analyze")
        .arg(format!("--root={}", root.display()))
        .args(args)
        .output()
        .expect("systemd-analyze is not installed (scripts/test.sh installs the systemd package)")
}

/// `Key=value` lines of a unit's `[Service]` section.
fn unit_values(text: &str, key: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix(&format!("{key}=")))
        .map(str::to_string)
        .collect()
}

#[test]
fn systemd_units_verify_and_agree_with_the_binary() {
    let r = systemd_root();
    let out = systemd_analyze(
        r.path(),
        &[
            "verify",
            "fine-settler@0.service",
            "fine-settler-migrate.service",
            "fine-settler.target",
        ],
    );
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify: {said}"
    );
    // Hardening: exposure 1.2 ("OK") when written; fail if it regresses past 2.0.
    let out = systemd_analyze(
        r.path(),
        &[
            "security",
            "--offline=true",
            "--threshold=20",
            "fine-settler@0.service",
        ],
    );
    assert!(
        out.status.success(),
        "systemd-analyze security: {}",
        String::from_utf8_lossy(&out.stdout)
    );

    let unit = read("deploy/systemd/fine-settler@.service");
    assert_eq!(unit_values(&unit, "Type"), ["notify"]);
    assert_eq!(unit_values(&unit, "RestartPreventExitStatus"), ["2"]);
    assert_eq!(
        unit_values(&unit, "Environment"),
        ["FINE_SETTLER__INSTANCE__SHARD=%i", "HOSTNAME=%H"]
    );
    let exec = unit_values(&unit, "ExecStart").remove(0);
    let config_path = exec
        .split_whitespace()
        .skip_while(|w| *w != "--config")
        .nth(1)
        .expect("ExecStart names --config");
    assert!(exec.ends_with(" run"), "{exec}");
    assert_eq!(config_path, "/etc/fine-settler/fine-settler.toml");

    // The shipped shared config validates for every instance 0..shards and refuses the next one.
    let config = root().join("deploy/systemd/fine-settler.toml");
    let toml: toml::Value = toml::from_str(&read("deploy/systemd/fine-settler.toml")).expect("toml");
    let shards = toml["instance"]["shards"].as_integer().expect("shards");
    for shard in 0..shards {
        let out = check_config(&config, &[("FINE_SETTLER__INSTANCE__SHARD", shard.to_string())]);
        assert_exit(&out, 0, &format!("instance {shard}"));
    }
    let out = check_config(&config, &[("FINE_SETTLER__INSTANCE__SHARD", shards.to_string())]);
    assert_exit(&out, 2, "an instance past the shard count");

    // The watchdog allows two batch timeouts (the binary refuses less); stopping allows the drain.
    let watchdog = duration(&unit_values(&unit, "WatchdogSec")[0]);
    let batch = duration(toml["claim"]["batch_timeout"].as_str().unwrap_or("30s"));
    assert!(watchdog >= batch * 2, "WatchdogSec {watchdog:?} < 2 x {batch:?}");
    let stop = duration(&unit_values(&unit, "TimeoutStopSec")[0]);
    let drain = duration(toml["schedule"]["drain_timeout"].as_str().unwrap_or("30s"));
    assert!(stop > drain, "TimeoutStopSec {stop:?} <= drain_timeout {drain:?}");
}

#[test]
fn alert_rules_are_valid_prometheus_rules() {
    let docs = yaml_docs("deploy/prometheus/fine-settler.rules.yml");
    let groups = docs[0]["groups"].as_array().expect("groups");
    let mut alerts = 0;
    for group in groups {
        assert!(group["name"].is_string());
        for rule in group["rules"].as_array().expect("rules") {
            let name = rule["alert"].as_str().expect("every rule is an alert");
            let expr = rule["expr"].as_str().expect("expr");
            if let Err(e) = promql_parser::parser::parse(expr) {
                panic!("{name}: invalid PromQL {expr:?}: {e}");
            }
            if let Some(f) = rule["for"].as_str() {
                duration(f);
            }
            assert!(
                ["page", "ticket"].contains(&rule["labels"]["severity"].as_str().unwrap_or("")),
                "{name}: severity"
            );
            assert!(rule["annotations"]["summary"].is_string(), "{name}: summary");
            alerts += 1;
        }
    }
    assert!(alerts >= 6);
}

const RULES: &str = "deploy/prometheus/fine-settler.rules.yml";
const RULE_TESTS: &str = "deploy/prometheus/fine-settler.rules.test.yml";

/// `promtool ARGS` in the crate root. Not skipped when promtool is missing: the rules are only tested by it.
fn promtool(args: &[&str]) -> Output {
    Command::new("promtool")
        .args(args)
        .current_dir(root())
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run promtool ({e}): install Debian's prometheus package \
                 (apt-get install --no-install-recommends prometheus), or run scripts/test.sh, which installs it"
            )
        })
}

#[test]
fn alert_rules_pass_promtool_and_their_unit_tests() {
    for args in [["check", "rules", RULES], ["test", "rules", RULE_TESTS]] {
        let out = promtool(&args);
        assert!(
            out.status.success(),
            "promtool {} failed ({}):\n{}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // The unit tests evaluate the shipped rules (rule_files are relative to the test file's directory) ...
    let tests = &yaml_docs(RULE_TESTS)[0];
    let dir = Path::new(RULE_TESTS).parent().expect("directory");
    let rule_files: Vec<PathBuf> = tests["rule_files"]
        .as_array()
        .expect("rule_files")
        .iter()
        .map(|f| dir.join(f.as_str().expect("a path")))
        .collect();
    assert_eq!(rule_files, [PathBuf::from(RULES)]);
    // ... and every alert has a case where it fires and one where it stays silent, so a new alert without
    // tests fails here.
    let rules = yaml_docs(RULES);
    let alerts: BTreeSet<&str> = rules[0]["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules"))
        .map(|r| r["alert"].as_str().expect("every rule is an alert"))
        .collect();
    let (mut firing, mut silent) = (BTreeSet::new(), BTreeSet::new());
    for group in tests["tests"].as_array().expect("tests") {
        for case in group["alert_rule_test"].as_array().into_iter().flatten() {
            let name = case["alertname"].as_str().expect("alertname");
            assert!(
                alerts.contains(name),
                "{RULE_TESTS} tests {name}, which is not an alert of {RULES}"
            );
            match case["exp_alerts"].as_array() {
                Some(exp) if exp.is_empty() => silent.insert(name),
                Some(_) => firing.insert(name),
                None => panic!(
                    "{name} at {}: no exp_alerts (write `exp_alerts: []` for silence)",
                    case["eval_time"]
                ),
            };
        }
    }
    for alert in &alerts {
        assert!(
            firing.contains(alert),
            "{RULE_TESTS} has no case where {alert} fires (exp_alerts with the alert it produces)"
        );
        assert!(
            silent.contains(alert),
            "{RULE_TESTS} has no case where {alert} stays silent (exp_alerts: [])"
        );
    }
}

#[test]
fn the_dashboard_queries_are_valid_promql() {
    let dashboard: Value = serde_json::from_str(&read("deploy/grafana/fine-settler.json")).expect("JSON");
    let mut queries = 0;
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("every target has an expr");
            // Grafana's range variable, as Grafana would fill it in.
            let expr = expr.replace("$__rate_interval", "5m");
            if let Err(e) = promql_parser::parser::parse(&expr) {
                panic!("{}: invalid PromQL {expr:?}: {e}", panel["title"]);
            }
            queries += 1;
        }
    }
    assert!(queries >= 6, "{queries} queries");
}

/// A replica that has settled a month serves `/metrics` that `promtool check metrics` finds nothing to say
/// about, with only series the registry declares, the run duration histogram among them.
#[sqlx::test(fixtures("default_policy"))]
async fn a_running_replicas_metrics_pass_promtool_check_metrics(pool: PgPool) {
    let month_end = due_now(&pool, 1).await[0].to_string();
    let loans: Vec<_> = (1..=60)
        .map(|id| loan(id, &format!("{}-01", &month_end[..7]), Some(&month_end)))
        .collect();
    insert(&pool, &loans).await;
    let port = free_port();
    let replica = daemon(
        &database_url(&pool),
        0,
        1,
        &[
            ("FINE_SETTLER__HTTP__LISTEN", &format!("127.0.0.1:{port}")),
            ("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1"),
        ],
    );
    wait_until("the month settled", Duration::from_secs(30), || async {
        sqlx::query_scalar::<_, i64>("select count(*) from job_runs where status = 'SUCCESS'")
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
            == 1
    })
    .await;
    let (status, scrape) = http_get(port, "/metrics").await;
    assert_eq!(stop(replica).await.0, Some(0));
    assert_eq!(status, 200, "{scrape}");

    let mut check = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is not installed (scripts/test.sh installs the prometheus package)");
    std::io::Write::write_all(&mut check.stdin.take().expect("stdin"), scrape.as_bytes()).expect("write");
    let out = check.wait_with_output().expect("promtool");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics: {said}\non:\n{scrape}"
    );

    let declared = fine_settler::metrics::Metrics::new("0/1".into()).series_names();
    let served: BTreeSet<&str> = scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    for name in &served {
        assert!(declared.contains(*name), "{name} is served but not declared");
    }
    for name in [
        "fine_settler_run_duration_seconds_bucket",
        "fine_settler_claims_total",
        "fine_settler_last_progress_timestamp_seconds",
    ] {
        assert!(served.contains(name), "{name} missing from:\n{scrape}");
    }
}

/// `check-config` prints the shard the replica will run when it comes from the pod (its name or its index), not
/// the file's `instance.shard`.
#[test]
fn check_config_prints_the_shard_resolved_from_the_pod() {
    for (from, var, value, shard) in [
        ("pod-name", "POD_NAME", "fine-settler-10", 10),
        ("pod-index", "POD_INDEX", "7", 7),
    ] {
        let mut cmd = crate::helpers::fine_settler("postgres://settler@db.example/libraryd");
        cmd.env("FINE_SETTLER__INSTANCE__SHARDS", "12")
            .env("FINE_SETTLER__INSTANCE__SHARD_FROM", from)
            .env(var, value)
            .arg("check-config");
        let out = crate::helpers::output(cmd);
        assert_exit(&out, 0, from);
        let shown: toml::Value = toml::from_str(&String::from_utf8_lossy(&out.stdout)).expect("TOML");
        assert_eq!(shown["instance"]["shard"].as_integer(), Some(shard), "{from}");
        assert_eq!(shown["instance"]["shard_from"].as_str(), Some(from));
    }
}
