//! `database.url`: libpq's connection URL, parsed once into what every connection is opened with — the host list
//! (`h1:p1,h2:p2` in the authority or `?host=…&port=…`, IPv6 addresses in brackets, socket directories), the two
//! libpq parameters sqlx does not know (`target_session_attrs`, `connect_timeout`), and the URL as it may be shown
//! (password redacted). Everything else in the URL is sqlx's to read, per host. Also the rule that no startup
//! `options` go through a pooler ([`DatabaseUrl::check_pooler`]).

use std::{collections::HashMap, fmt, net::Ipv6Addr, str::FromStr, time::Duration};

use sqlx::postgres::PgConnectOptions;

use crate::{config::Pooler, redact};

/// `database.url`, parsed once into the options every connection is opened with: one [`PgConnectOptions`] per
/// host of libpq's multi-host form, in the URL's order. Its `Debug` and `Display` show the URL with the password
/// redacted, so a settings dump in a log cannot leak it.
///
/// sqlx parses a URL of one host only and does not know `target_session_attrs` or `connect_timeout`. So the host
/// list is split here the way libpq splits it, and each host is handed to sqlx in a URL of its own: everything
/// else (user, password, database, `sslmode`, `application_name`, `options`, …) is read by sqlx exactly as it
/// reads a single-host URL, hence identical for every host, and a password file is looked up per host as libpq
/// does. The two libpq parameters sqlx does not know are read here and removed from what sqlx sees.
#[derive(Clone)]
pub struct DatabaseUrl {
    /// Never empty.
    hosts: Vec<PgConnectOptions>,
    target: TargetSessionAttrs,
    host_timeout: Option<Duration>,
    shown: String,
}

/// libpq's `target_session_attrs`: which server of the host list a connection may settle on. fine-settler writes,
/// so only the values under which the server found can take writes are accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TargetSessionAttrs {
    /// The first server that accepts the connection (libpq's default).
    #[default]
    Any,
    /// A server whose sessions accept read-write transactions by default (`read-write`).
    ReadWrite,
    /// A server that is not in hot standby (`primary`).
    Primary,
}

/// Why `database.url` cannot be used. Every message shows the URL with its password redacted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DatabaseUrlError {
    /// Neither the config file nor `DATABASE_URL` gives a URL.
    #[error("is empty; set it in the config file or in DATABASE_URL")]
    Empty,
    /// Another scheme than `postgres://` or `postgresql://` (a `mysql://` URL, a key=value string).
    #[error("{url} must start with postgres:// or postgresql://")]
    Scheme { url: String },
    /// sqlx refuses the URL of a host (a bad `sslmode`, a user name that is not UTF-8, …).
    #[error("{url} is not a valid URL: {reason}")]
    Invalid { url: String, reason: String },
    /// A list of several hosts with an empty entry: `h1,,h2`, `h1,`.
    #[error("{url}: host {position} of {count} is empty (two commas in a row, or a comma at an end)")]
    EmptyHost {
        url: String,
        position: usize,
        count: usize,
    },
    /// A host that is neither a host name, an IP address nor a socket directory.
    #[error("{url}: host {host:?} {why}")]
    BadHost {
        url: String,
        host: String,
        why: &'static str,
    },
    /// A port that is not a number from 1 to 65535.
    #[error("{url}: port {port:?} of host {host:?} is not a number from 1 to 65535")]
    BadPort { url: String, host: String, port: String },
    /// The part before the host holds an unescaped `/`, `?` or `#` (in a password, most likely), so the host list
    /// seems to start inside it; nothing of it is quoted.
    #[error("{url}: the user or password holds a '/', '?' or '#': percent-encode it (%2F, %3F, %23)")]
    UnencodedUserinfo { url: String },
    /// `port=` lists neither one port for all hosts nor one per host.
    #[error("{url}: {ports} ports for {hosts} hosts; give one port for all hosts, or one per host")]
    PortCount { url: String, ports: usize, hosts: usize },
    /// `hostaddr=` overrides the host of every connection sqlx makes, so with several hosts each would reach the
    /// same address.
    #[error("{url}: hostaddr= cannot be combined with several hosts; list the addresses as hosts instead")]
    HostaddrWithHosts { url: String },
    /// A `target_session_attrs` libpq knows but under which the server found may refuse writes.
    #[error(
        "{url}: target_session_attrs={value} is not supported: fine-settler writes, so it only accepts \
         any, read-write or primary"
    )]
    ReadOnlyTarget { url: String, value: String },
    /// A `target_session_attrs` libpq does not know either.
    #[error("{url}: target_session_attrs={value:?} is not one of any, read-write, primary")]
    UnknownTarget { url: String, value: String },
    /// A `connect_timeout` that is not a whole number of seconds.
    #[error("{url}: connect_timeout={value:?} is not a whole number of seconds")]
    BadTimeout { url: String, value: String },
}

/// Why `database.url`'s connections cannot go through the configured pooler: they would send the startup
/// parameter `options`, which PgBouncer refuses with its default settings ("unsupported startup parameter:
/// options"), so every connection would fail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolerOptionsError {
    /// `PGOPTIONS` is set in the environment: sqlx reads it, as libpq does, and sends it at every login.
    #[error(
        "PGOPTIONS is set, but behind a pooler (\"{pooler}\") no startup options may be sent: PgBouncer refuses \
         them (\"unsupported startup parameter: options\"), and fine-settler sets its session settings itself; \
         unset PGOPTIONS for fine-settler (env -u PGOPTIONS fine-settler …)"
    )]
    Environment { pooler: &'static str },
    /// The URL has an `options=` parameter.
    #[error(
        "database.url has options=…, but behind a pooler (\"{pooler}\") no startup options may be sent: \
         PgBouncer refuses them (\"unsupported startup parameter: options\"); remove options= from the URL"
    )]
    Url { pooler: &'static str },
}

/// The query parameters read here rather than by sqlx: the host list, its ports, and the two libpq parameters
/// sqlx does not know (it would log them as unrecognized and ignore them).
const OWN_PARAMETERS: [&str; 4] = ["host", "port", "target_session_attrs", "connect_timeout"];

impl DatabaseUrl {
    /// Parses a `postgres://` or `postgresql://` URL, with one host or libpq's list of hosts (in the authority,
    /// `h1:5432,h2:5433`, or as `?host=h1,h2&port=5432,5433`); the error (redacted) names what is wrong with it.
    pub fn parse(url: &str) -> Result<Self, DatabaseUrlError> {
        let url = url.trim();
        let shown = redact::url(url);
        if url.is_empty() {
            return Err(DatabaseUrlError::Empty);
        }
        let Some((scheme, rest)) = ["postgres://", "postgresql://"]
            .into_iter()
            .find_map(|scheme| url.strip_prefix(scheme).map(|rest| (scheme, rest)))
        else {
            return Err(DatabaseUrlError::Scheme { url: shown });
        };
        let uri = Uri::split(rest);
        let own = |name: &str| {
            uri.params
                .iter()
                .rev()
                .find(|p| p.name == name)
                .map(|p| p.value.as_str())
        };
        let target = match own("target_session_attrs") {
            None => TargetSessionAttrs::Any,
            Some(value) => TargetSessionAttrs::parse(value, &shown)?,
        };
        let host_timeout = own("connect_timeout")
            .map(|value| libpq_connect_timeout(value, &shown))
            .transpose()?
            .flatten();
        // An '@' after the first '/', '?' or '#' but none before: the password (or user) holds one of those, and
        // what looks like the host list is part of it, so an error about it would quote the password.
        let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
        let cut_userinfo = !authority.contains('@') && rest.contains('@');
        let endpoints = endpoints(&uri, own("host"), own("port"), &shown).map_err(|e| match e {
            DatabaseUrlError::BadPort { .. } | DatabaseUrlError::BadHost { .. } if cut_userinfo => {
                DatabaseUrlError::UnencodedUserinfo { url: shown.clone() }
            }
            e => e,
        })?;
        if endpoints.len() > 1 && uri.params.iter().any(|p| p.name == "hostaddr") {
            return Err(DatabaseUrlError::HostaddrWithHosts { url: shown });
        }
        let kept: Vec<&str> = uri
            .params
            .iter()
            .filter(|p| !OWN_PARAMETERS.contains(&p.name.as_str()))
            .map(|p| p.raw)
            .collect();
        let hosts = endpoints
            .iter()
            .map(|endpoint| {
                let one = endpoint.url(scheme, uri.userinfo, uri.path, &kept);
                PgConnectOptions::from_str(&one).map_err(|e| DatabaseUrlError::Invalid {
                    url: shown.clone(),
                    reason: redact::secrets_in(&e.to_string()),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        // fine-settler writes: of several hosts, one that answers but cannot write (a standby listed first, the
        // routine layout after a failover) must not hold the replica, so `any` — libpq's "the first that
        // answers" — means `read-write` there. With one host there is no other to move to: a read-only server
        // is an outage the replica waits out.
        let target = match target {
            TargetSessionAttrs::Any if hosts.len() > 1 => TargetSessionAttrs::ReadWrite,
            target => target,
        };
        Ok(DatabaseUrl {
            hosts,
            target,
            host_timeout,
            shown,
        })
    }

    /// One set of connection options per host, in the URL's order (at least one). They differ only in host and
    /// port (and in a password found in the password file for that host).
    pub fn hosts(&self) -> &[PgConnectOptions] {
        &self.hosts
    }

    /// The connection options of the first host (each connection adds its application name).
    pub fn connect_options(&self) -> &PgConnectOptions {
        // `parse` builds one per host, and a URL names at least one (an empty host list is the default host).
        &self.hosts[0]
    }

    /// Which server of the list a connection may settle on (`target_session_attrs`, default `any`; with several
    /// hosts `any` is `read-write`: a host that cannot write is passed over).
    pub fn target(&self) -> TargetSessionAttrs {
        self.target
    }

    /// How long to wait for one host before trying the next (`connect_timeout`); `None`: no limit of its own.
    pub fn host_timeout(&self) -> Option<Duration> {
        self.host_timeout
    }

    /// The URL with its password replaced by `***`.
    pub fn redacted(&self) -> &str {
        &self.shown
    }

    /// Refuses connections that would send the startup parameter `options` behind `pooler` (see
    /// [`PoolerOptionsError`]); `env` is the process's environment, in which sqlx found `PGOPTIONS`.
    ///
    /// The parameter cannot be left out instead: sqlx reads `PGOPTIONS` whenever it parses a URL, and its
    /// options have no way to unset what it read (they only append to it). Removing the variable from the
    /// process's environment before parsing is not sound once threads run (it is `unsafe` from the 2024
    /// edition). And a refusal is the safer answer anyway: the variable may carry settings the operator meant for
    /// fine-settler (a `search_path`), which a silent drop would lose.
    pub fn check_pooler(
        &self,
        pooler: Pooler,
        env: &HashMap<String, String>,
    ) -> Result<(), PoolerOptionsError> {
        if pooler == Pooler::None || self.connect_options().get_options().is_none() {
            return Ok(());
        }
        let pooler = pooler.as_str();
        Err(if env.contains_key("PGOPTIONS") {
            PoolerOptionsError::Environment { pooler }
        } else {
            PoolerOptionsError::Url { pooler }
        })
    }
}

impl TargetSessionAttrs {
    fn parse(value: &str, shown: &str) -> Result<Self, DatabaseUrlError> {
        match value {
            "any" => Ok(TargetSessionAttrs::Any),
            "read-write" => Ok(TargetSessionAttrs::ReadWrite),
            "primary" => Ok(TargetSessionAttrs::Primary),
            "read-only" | "standby" | "prefer-standby" => Err(DatabaseUrlError::ReadOnlyTarget {
                url: shown.to_string(),
                value: value.to_string(),
            }),
            _ => Err(DatabaseUrlError::UnknownTarget {
                url: shown.to_string(),
                value: value.to_string(),
            }),
        }
    }

    /// The value as libpq spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            TargetSessionAttrs::Any => "any",
            TargetSessionAttrs::ReadWrite => "read-write",
            TargetSessionAttrs::Primary => "primary",
        }
    }
}

impl fmt::Display for TargetSessionAttrs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `connect_timeout` as libpq reads it: whole seconds; zero or negative means no limit, and 1 means 2 (libpq's
/// minimum, so that a slow first packet does not fail a connection that would have worked).
fn libpq_connect_timeout(value: &str, shown: &str) -> Result<Option<Duration>, DatabaseUrlError> {
    let seconds: i64 = value.trim().parse().map_err(|_| DatabaseUrlError::BadTimeout {
        url: shown.to_string(),
        value: value.to_string(),
    })?;
    Ok(u64::try_from(seconds)
        .ok()
        .filter(|s| *s > 0)
        .map(|s| Duration::from_secs(s.max(2))))
}

/// A URL cut where libpq cuts it: after the scheme, the authority runs to the first `/`, `?` or `#`; its user
/// information ends at its last `@`; the query runs from `?` to `#`.
struct Uri<'a> {
    /// Without the `@`.
    userinfo: Option<&'a str>,
    /// The authority's host list, as written: `h1:5432,[::1]:5433`.
    hosts: &'a str,
    /// `/db`, or empty.
    path: &'a str,
    params: Vec<Param<'a>>,
}

/// One `name=value` of the query: its text as written (handed to sqlx unchanged) and decoded.
struct Param<'a> {
    raw: &'a str,
    name: String,
    value: String,
}

impl<'a> Uri<'a> {
    fn split(rest: &'a str) -> Self {
        let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => (Some(userinfo), hosts),
            None => (None, authority),
        };
        let tail = tail.split_once('#').map_or(tail, |(before, _)| before);
        let (path, query) = tail.split_once('?').unwrap_or((tail, ""));
        let params = query
            .split('&')
            .filter(|raw| !raw.is_empty())
            .map(|raw| {
                let (name, value) = raw.split_once('=').unwrap_or((raw, ""));
                Param {
                    raw,
                    name: percent_decode(name, true),
                    value: percent_decode(value, true),
                }
            })
            .collect();
        Uri {
            userinfo,
            hosts,
            path,
            params,
        }
    }
}

/// One host of the list and its port (`None`: the default, `PGPORT` or 5432, as sqlx picks it).
#[derive(Debug, PartialEq, Eq)]
struct Endpoint {
    /// Decoded; an IPv6 address without its brackets; empty only as the single, default host.
    host: String,
    port: Option<u16>,
}

impl Endpoint {
    /// The URL sqlx parses for this host: the original with this host (and port) as the authority's only one and
    /// the parameters read here removed.
    fn url(&self, scheme: &str, userinfo: Option<&str>, path: &str, kept: &[&str]) -> String {
        let mut url = String::from(scheme);
        if let Some(userinfo) = userinfo {
            url.push_str(userinfo);
            url.push('@');
        }
        let ipv6 = self.host.contains(':');
        if ipv6 {
            url.push('[');
            url.push_str(&self.host);
            url.push(']');
        } else {
            // A socket directory is written percent-encoded; sqlx decodes it and connects to its socket.
            url.push_str(&percent_encode(&self.host));
        }
        if let Some(port) = self.port {
            url.push_str(&format!(":{port}"));
        }
        url.push_str(path);
        let mut params: Vec<String> = Vec::new();
        if ipv6 {
            // sqlx keeps the brackets of an authority's IPv6 address in the host name (and TLS then refuses it as
            // a server name); a `host` parameter, read after the authority, gives it the bare address.
            params.push(format!("host={}", percent_encode(&self.host)));
        }
        params.extend(kept.iter().map(|p| p.to_string()));
        if !params.is_empty() {
            url.push('?');
            url.push_str(&params.join("&"));
        }
        url
    }
}

/// The hosts and ports as libpq pairs them: `host=` replaces the authority's hosts and `port=` its ports; one
/// port applies to every host, otherwise there is one per host.
fn endpoints(
    uri: &Uri<'_>,
    host_param: Option<&str>,
    port_param: Option<&str>,
    shown: &str,
) -> Result<Vec<Endpoint>, DatabaseUrlError> {
    let (mut hosts, mut ports) = authority_hosts(uri.hosts, shown)?;
    if let Some(list) = host_param {
        hosts = list.split(',').map(unbracketed).collect();
    }
    if let Some(list) = port_param {
        ports = list.split(',').collect();
    }
    check_hosts(&hosts, shown)?;
    if ports.len() != 1 && ports.len() != hosts.len() {
        return Err(DatabaseUrlError::PortCount {
            url: shown.to_string(),
            ports: ports.len(),
            hosts: hosts.len(),
        });
    }
    hosts
        .into_iter()
        .enumerate()
        .map(|(i, host)| {
            let port = if ports.len() == 1 { ports[0] } else { ports[i] };
            let port = parse_port(port, &host, shown)?;
            Ok(Endpoint { host, port })
        })
        .collect()
}

/// The authority's list, `h1:5432,[::1]:5433,h3`, as hosts (decoded, IPv6 addresses without brackets) and
/// their ports as written (empty: none given).
fn authority_hosts<'a>(list: &'a str, shown: &str) -> Result<(Vec<String>, Vec<&'a str>), DatabaseUrlError> {
    let mut hosts = Vec::new();
    let mut ports = Vec::new();
    for entry in list.split(',') {
        let (host, port) = match entry.strip_prefix('[') {
            Some(bracketed) => bracketed_host(entry, bracketed, shown)?,
            None => {
                let (host, port) = entry.split_once(':').unwrap_or((entry, ""));
                (percent_decode(host, false), port)
            }
        };
        hosts.push(host);
        ports.push(port);
    }
    Ok((hosts, ports))
}

/// An authority entry `[ADDRESS]` or `[ADDRESS]:PORT` (`bracketed` is `entry` after its `[`): the IPv6 address
/// and the port as written.
fn bracketed_host<'a>(
    entry: &str,
    bracketed: &'a str,
    shown: &str,
) -> Result<(String, &'a str), DatabaseUrlError> {
    let (address, after) = bracketed
        .split_once(']')
        .ok_or_else(|| bad_host(shown, entry, "has no closing ]"))?;
    let port = match after {
        "" => "",
        _ => after
            .strip_prefix(':')
            .ok_or_else(|| bad_host(shown, entry, "has text after ] that is not :PORT"))?,
    };
    if address.parse::<Ipv6Addr>().is_err() {
        return Err(bad_host(shown, address, "in brackets is not an IPv6 address"));
    }
    Ok((address.to_string(), port))
}

/// A host of `host=`, where an IPv6 address may be written with or without brackets.
fn unbracketed(host: &str) -> String {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
        .to_string()
}

/// Every host is one [`check_host`] accepts, and only a list of one may leave its host empty (the default).
fn check_hosts(hosts: &[String], shown: &str) -> Result<(), DatabaseUrlError> {
    if hosts.len() > 1 {
        if let Some(position) = hosts.iter().position(String::is_empty) {
            return Err(DatabaseUrlError::EmptyHost {
                url: shown.to_string(),
                position: position + 1,
                count: hosts.len(),
            });
        }
    }
    for host in hosts {
        check_host(host).map_err(|why| bad_host(shown, host, why))?;
    }
    Ok(())
}

/// A port as written for `host`: empty is the default (`None`); otherwise digits only, from 1 to 65535.
fn parse_port(text: &str, host: &str, shown: &str) -> Result<Option<u16>, DatabaseUrlError> {
    if text.is_empty() {
        return Ok(None);
    }
    text.parse::<u16>()
        .ok()
        .filter(|p| *p != 0 && text.bytes().all(|b| b.is_ascii_digit()))
        .map(Some)
        .ok_or_else(|| DatabaseUrlError::BadPort {
            url: shown.to_string(),
            host: host.to_string(),
            port: text.to_string(),
        })
}

fn bad_host(shown: &str, host: &str, why: &'static str) -> DatabaseUrlError {
    DatabaseUrlError::BadHost {
        url: shown.to_string(),
        host: host.to_string(),
        why,
    }
}

/// A host is a name or IPv4 address (letters, digits, `.`, `-`, `_`), an IPv6 address, or a socket directory
/// (an absolute path); empty is the default host.
fn check_host(host: &str) -> Result<(), &'static str> {
    if host.is_empty() || host.starts_with('/') {
        return Ok(());
    }
    if host.contains(':') {
        return match host.parse::<Ipv6Addr>() {
            Ok(_) => Ok(()),
            Err(_) => Err("is not an IPv6 address (a host name has no ':'; write a port as HOST:PORT)"),
        };
    }
    if host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
    {
        return Ok(());
    }
    Err("is not a host name, an IP address or a socket directory")
}

/// Decodes `%XX` escapes (and, in a query, `+` as a space); text that is not UTF-8 is decoded lossily, as sqlx
/// decodes query parameters.
fn percent_decode(text: &str, plus_is_space: bool) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(hi), Some(lo)) => {
                    out.push(hi * 16 + lo);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' if plus_is_space => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

/// Escapes everything but unreserved characters, for a host written into a URL.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("DatabaseUrl").field(&self.shown).finish()
    }
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use proptest::prelude::*;
    use sqlx::postgres::PgSslMode;

    use super::*;

    fn parse(url: &str) -> DatabaseUrl {
        DatabaseUrl::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    fn error(url: &str) -> String {
        match DatabaseUrl::parse(url) {
            Ok(parsed) => panic!("{url} was accepted: {:?}", parsed.hosts()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn no_startup_options_go_through_a_pooler() {
        let plain = parse("postgres://u@db/libraryd");
        let with_options = parse("postgres://u@db/libraryd?options=-c%20search_path%3Dlib");
        let none = crate::testing::env(&[]);
        let pgoptions = crate::testing::env(&[("PGOPTIONS", "-c statement_timeout=5min")]);
        // Directly, the options are sent, as libpq sends them.
        assert_eq!(with_options.check_pooler(Pooler::None, &pgoptions), Ok(()));
        for pooler in [Pooler::Session, Pooler::Transaction] {
            // (Unless the test's own environment has PGOPTIONS: sqlx read it when the URL was parsed.)
            if std::env::var_os("PGOPTIONS").is_none() {
                assert_eq!(plain.check_pooler(pooler, &none), Ok(()));
            }
            let url = with_options.check_pooler(pooler, &none).expect_err("refused");
            assert_eq!(
                url,
                PoolerOptionsError::Url {
                    pooler: pooler.as_str()
                }
            );
            assert!(url.to_string().contains("remove options="), "{url}");
            let env = with_options
                .check_pooler(pooler, &pgoptions)
                .expect_err("refused");
            assert_eq!(
                env,
                PoolerOptionsError::Environment {
                    pooler: pooler.as_str()
                }
            );
            assert!(env.to_string().starts_with("PGOPTIONS is set"), "{env}");
        }
    }

    /// The port sqlx gives a host without one (`PGPORT`, else 5432).
    fn default_port() -> u16 {
        PgConnectOptions::new_without_pgpass().get_port()
    }

    fn endpoints(url: &DatabaseUrl) -> Vec<(String, u16)> {
        url.hosts()
            .iter()
            .map(|o| (o.get_host().to_string(), o.get_port()))
            .collect()
    }

    #[test]
    fn a_single_host_url_gives_what_sqlx_gives_it() {
        for url in [
            "postgres://fine_settler@localhost/libraryd",
            "postgres://u:hunter2@db.example:6432/libraryd?sslmode=require&application_name=x",
            "postgresql://u@10.0.0.7/db?options=-c%20search_path%3Dlib&statement-cache-capacity=7",
            "postgres://u%40corp:p%2Fw@h/d%20b?user=other&password=p2",
            "postgres://u@h/db?host=other&port=7000&sslrootcert=/etc/ca.pem",
            "postgres://%2Fvar%2Frun%2Fpostgresql/db",
            "postgres:///db?host=/tmp",
            "postgres:///db",
            "postgres://h:/db",
        ] {
            let ours = parse(url);
            let sqlx = PgConnectOptions::from_str(url).expect("sqlx parses it");
            assert_eq!(ours.hosts().len(), 1, "{url}");
            // Debug prints every field, the password included.
            assert_eq!(
                format!("{:?}", ours.connect_options()),
                format!("{sqlx:?}"),
                "{url}"
            );
            assert_eq!(ours.target(), TargetSessionAttrs::Any, "{url}");
            assert_eq!(ours.host_timeout(), None, "{url}");
        }
        let single = parse("postgres://u:pw@db.example:6432/libraryd?sslmode=verify-full");
        let o = single.connect_options();
        assert_eq!(
            (o.get_host(), o.get_port(), o.get_username(), o.get_database()),
            ("db.example", 6432, "u", Some("libraryd"))
        );
        assert!(matches!(o.get_ssl_mode(), PgSslMode::VerifyFull));
        assert_eq!(
            parse("postgres://h/db?host=/var/run/x")
                .connect_options()
                .get_socket(),
            Some(&std::path::PathBuf::from("/var/run/x"))
        );
    }

    #[test]
    fn several_hosts_in_the_authority_each_get_the_same_options() {
        let url = parse(
            "postgres://u:pw@h1:5432,h2:5433,10.1.2.3/libraryd?sslmode=require&application_name=a&options=-c%20x%3D1",
        );
        assert_eq!(
            endpoints(&url),
            vec![
                ("h1".to_string(), 5432),
                ("h2".to_string(), 5433),
                ("10.1.2.3".to_string(), default_port())
            ]
        );
        // Apart from host and port, every host's options are the first's.
        let first = format!("{:?}", url.connect_options());
        for (i, o) in url.hosts().iter().enumerate() {
            let same = o.clone().host("h1").port(5432);
            assert_eq!(format!("{same:?}"), first, "host {i}");
            assert_eq!(o.get_username(), "u");
            assert_eq!(o.get_database(), Some("libraryd"));
            assert!(matches!(o.get_ssl_mode(), PgSslMode::Require));
            assert_eq!(o.get_application_name(), Some("a"));
            assert_eq!(o.get_options(), Some("-c x=1"));
        }
        assert_eq!(url.connect_options().get_host(), "h1");
        let two = parse("postgresql://u@a.example,b.example/db");
        assert_eq!(
            endpoints(&two),
            vec![
                ("a.example".to_string(), default_port()),
                ("b.example".to_string(), default_port())
            ]
        );
    }

    #[test]
    fn ipv6_addresses_are_bracketed_in_the_authority_and_bare_in_the_options() {
        let url = parse("postgres://u@[::1]:5432,[2001:db8::7],h3:5434/db");
        assert_eq!(
            endpoints(&url),
            vec![
                ("::1".to_string(), 5432),
                ("2001:db8::7".to_string(), default_port()),
                ("h3".to_string(), 5434)
            ]
        );
        let single = parse("postgres://[fe80::1]:6000/db");
        assert_eq!(endpoints(&single), vec![("fe80::1".to_string(), 6000)]);
        let query = parse("postgres:///db?host=::1,h2&port=5432");
        assert_eq!(
            endpoints(&query),
            vec![("::1".to_string(), 5432), ("h2".to_string(), 5432)]
        );
    }

    #[test]
    fn hosts_and_ports_can_be_query_parameters() {
        let url = parse("postgres://u:pw@/db?host=h1,h2,h3&port=5432,5433,5434&sslmode=disable");
        assert_eq!(
            endpoints(&url),
            vec![
                ("h1".to_string(), 5432),
                ("h2".to_string(), 5433),
                ("h3".to_string(), 5434)
            ]
        );
        // One port applies to every host.
        let url = parse("postgres:///db?host=h1,h2&port=6000");
        assert_eq!(
            endpoints(&url),
            vec![("h1".to_string(), 6000), ("h2".to_string(), 6000)]
        );
        // host= replaces the authority's hosts and port= their ports, as in libpq.
        let url = parse("postgres://x:1,y:2/db?host=h1,h2");
        assert_eq!(
            endpoints(&url),
            vec![("h1".to_string(), 1), ("h2".to_string(), 2)]
        );
        let url = parse("postgres://h1:1,h2:2/db?port=7000");
        assert_eq!(
            endpoints(&url),
            vec![("h1".to_string(), 7000), ("h2".to_string(), 7000)]
        );
        // An empty port in a list is the default one; a socket directory is a host like any other.
        let url = parse("postgres:///db?host=h1,/var/run/postgresql&port=,5433");
        assert_eq!(url.hosts()[0].get_port(), default_port());
        assert_eq!(
            url.hosts()[1].get_socket(),
            Some(&std::path::PathBuf::from("/var/run/postgresql"))
        );
        assert_eq!(url.hosts()[1].get_port(), 5433);
    }

    #[test]
    fn target_session_attrs_takes_the_values_under_which_writes_work() {
        for (value, target) in [
            ("any", TargetSessionAttrs::Any),
            ("read-write", TargetSessionAttrs::ReadWrite),
            ("primary", TargetSessionAttrs::Primary),
        ] {
            let url = parse(&format!("postgres://h1/db?target_session_attrs={value}"));
            assert_eq!(url.target(), target);
            assert_eq!(target.to_string(), value);
        }
        assert_eq!(parse("postgres://h1/db").target(), TargetSessionAttrs::Any);
        // Of several hosts, a read-only one never holds the replica: `any` (said or not) is `read-write`.
        for url in [
            "postgres://h1,h2/db",
            "postgres://h1,h2/db?target_session_attrs=any",
        ] {
            assert_eq!(parse(url).target(), TargetSessionAttrs::ReadWrite, "{url}");
        }
        assert_eq!(
            parse("postgres://h1,h2/db?target_session_attrs=primary").target(),
            TargetSessionAttrs::Primary
        );
        for value in ["read-only", "standby", "prefer-standby"] {
            assert_eq!(
                error(&format!("postgres://h/db?target_session_attrs={value}")),
                format!(
                    "postgres://h/db?target_session_attrs={value}: target_session_attrs={value} is not \
                     supported: fine-settler writes, so it only accepts any, read-write or primary"
                )
            );
        }
        assert_eq!(
            error("postgres://h/db?target_session_attrs=master"),
            "postgres://h/db?target_session_attrs=master: target_session_attrs=\"master\" is not one of any, \
             read-write, primary"
        );
    }

    #[test]
    fn connect_timeout_is_whole_seconds_as_in_libpq() {
        let timeout =
            |value: &str| parse(&format!("postgres://h1,h2/db?connect_timeout={value}")).host_timeout();
        assert_eq!(timeout("3"), Some(Duration::from_secs(3)));
        assert_eq!(timeout("0"), None);
        assert_eq!(timeout("-5"), None);
        assert_eq!(timeout("1"), Some(Duration::from_secs(2)), "libpq's minimum");
        assert_eq!(parse("postgres://h/db").host_timeout(), None);
        for value in ["3s", "1.5", "", "ten"] {
            assert_eq!(
                error(&format!("postgres://h/db?connect_timeout={value}")),
                format!(
                    "postgres://h/db?connect_timeout={value}: connect_timeout={value:?} is not a whole number \
                     of seconds"
                )
            );
        }
    }

    /// What sqlx logs while `url` is parsed.
    fn logged_while_parsing(url: &str) -> String {
        #[derive(Clone, Default)]
        struct Captured(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Captured {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().expect("not poisoned").extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::TRACE)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            parse(url);
        });
        let bytes = captured.0.lock().expect("not poisoned").clone();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// sqlx logs "ignoring unrecognized connect parameter" for these two and ignores them: they are read here and
    /// not handed on, while every other parameter is.
    #[test]
    fn the_libpq_parameters_read_here_are_not_handed_to_sqlx() {
        let url = "postgres://h1:5432,h2/db?connect_timeout=3&sslmode=require&target_session_attrs=primary";
        let logged = logged_while_parsing(url);
        assert!(!logged.contains("unrecognized"), "{logged}");
        // A parameter sqlx does not know is still handed on (and the capture sees what sqlx logs).
        let logged = logged_while_parsing("postgres://h1,h2/db?connect_timeout=3&keepalives=1");
        assert_eq!(
            logged.matches("ignoring unrecognized connect parameter").count(),
            2,
            "{logged}"
        );
        assert!(
            logged.contains("keepalives") && !logged.contains("connect_timeout"),
            "{logged}"
        );
        let parsed = parse(url);
        let kept = parse("postgres://h1:5432/db?sslmode=require");
        assert_eq!(
            format!("{:?}", parsed.connect_options()),
            format!("{:?}", kept.connect_options())
        );
    }

    /// Each URL is refused with exactly its message.
    fn assert_refused(cases: &[(&str, &str)]) {
        for (url, message) in cases {
            assert_eq!(error(url), *message, "{url}");
        }
    }

    #[test]
    fn an_empty_url_or_another_scheme_is_named() {
        assert_refused(&[
            ("", "is empty; set it in the config file or in DATABASE_URL"),
            (
                "mysql://u:pw@h/db",
                "mysql://u:***@h/db must start with postgres:// or postgresql://",
            ),
        ]);
    }

    #[test]
    fn an_empty_host_in_a_list_is_named_by_position() {
        assert_refused(&[
            (
                "postgres://u:pw@h1,,h2/db",
                "postgres://u:***@h1,,h2/db: host 2 of 3 is empty (two commas in a row, or a comma at an end)",
            ),
            (
                "postgres://h1,h2,/db",
                "postgres://h1,h2,/db: host 3 of 3 is empty (two commas in a row, or a comma at an end)",
            ),
            (
                "postgres:///db?host=,h2",
                "postgres:///db?host=,h2: host 1 of 2 is empty (two commas in a row, or a comma at an end)",
            ),
        ]);
    }

    #[test]
    fn a_bad_port_or_port_count_is_named() {
        assert_refused(&[
            (
                "postgres://h1:5432,h2:54x/db",
                "postgres://h1:5432,h2:54x/db: port \"54x\" of host \"h2\" is not a number from 1 to 65535",
            ),
            (
                "postgres://h1:70000/db",
                "postgres://h1:70000/db: port \"70000\" of host \"h1\" is not a number from 1 to 65535",
            ),
            (
                "postgres://h1:0,h2/db",
                "postgres://h1:0,h2/db: port \"0\" of host \"h1\" is not a number from 1 to 65535",
            ),
            (
                "postgres://h1:+5/db",
                "postgres://h1:+5/db: port \"+5\" of host \"h1\" is not a number from 1 to 65535",
            ),
            (
                "postgres:///db?host=h1,h2,h3&port=1,2",
                "postgres:///db?host=h1,h2,h3&port=1,2: 2 ports for 3 hosts; give one port for all hosts, or one \
                 per host",
            ),
            (
                "postgres://h1:1,h2:2/db?host=a,b,c",
                "postgres://h1:1,h2:2/db?host=a,b,c: 2 ports for 3 hosts; give one port for all hosts, or one per \
                 host",
            ),
        ]);
    }

    #[test]
    fn a_bad_host_is_named_with_what_is_wrong() {
        assert_refused(&[
            (
                "postgres://[::1:5432/db",
                "postgres://[::1:5432/db: host \"[::1:5432\" has no closing ]",
            ),
            (
                "postgres://[::1]5432/db",
                "postgres://[::1]5432/db: host \"[::1]5432\" has text after ] that is not :PORT",
            ),
            (
                "postgres://[db.example]/db",
                "postgres://[db.example]/db: host \"db.example\" in brackets is not an IPv6 address",
            ),
            (
                "postgres:///db?host=h1,::1::2",
                "postgres:///db?host=h1,::1::2: host \"::1::2\" is not an IPv6 address (a host name has no ':'; \
                 write a port as HOST:PORT)",
            ),
            (
                "postgres://h1,h%20x/db",
                "postgres://h1,h%20x/db: host \"h x\" is not a host name, an IP address or a socket directory",
            ),
            (
                "postgres://h1,h2/db?hostaddr=10.0.0.1",
                "postgres://h1,h2/db?hostaddr=10.0.0.1: hostaddr= cannot be combined with several hosts; list the \
                 addresses as hosts instead",
            ),
        ]);
    }

    #[test]
    fn sqlx_refusals_keep_their_form_for_every_host() {
        let message = error("postgres://u:pw@h1,h2/db?sslmode=sometimes");
        assert!(
            message.starts_with("postgres://u:***@h1,h2/db?sslmode=sometimes is not a valid URL: "),
            "{message}"
        );
        assert!(error("postgres://u@/db").starts_with("postgres://u@/db is not a valid URL: "));
    }

    #[test]
    fn a_multi_host_url_never_shows_its_password() {
        let url = parse("postgres://settler:hunter2@h1:5432,[::1]:5433/db?target_session_attrs=read-write");
        let shown = format!("{url} {url:?} {}", url.redacted());
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("settler:***@h1:5432,[::1]:5433/db"), "{shown}");
        let url = parse("postgres://settler@/db?host=h1,h2&password=hunter2");
        assert_eq!(url.redacted(), "postgres://settler@/db?host=h1,h2&password=***");
        // Nor does an error about it, even when the password ends the authority early.
        for bad in [
            "postgres://settler:hunter2@h1,,h2/db",
            "postgres://settler:hun/ter2@h1,h2/db",
            "postgres://settler:hunter2@h1,h2/db?target_session_attrs=standby",
            "postgres:///db?host=h1,h2&port=1,2,3&password=hunter2",
        ] {
            let message = error(bad);
            assert!(
                !message.contains("hunter2") && !message.contains("ter2") && !message.contains("\"hun\""),
                "{bad}: {message}"
            );
        }
        // A password with an unescaped '/', '?' or '#' cuts the authority inside it: no piece of it is quoted.
        for (bad, piece) in [
            ("postgres://settler:hunter2/xyz@db1:5432/libraryd", "hunter2"),
            ("postgres://u:s3cr3t?x@h/db", "s3cr3t"),
            ("postgres://u:pa#ss@h1,h2/db", "\"pa\""),
        ] {
            let message = error(bad);
            assert!(!message.contains(piece), "{bad}: {message}");
            assert!(message.contains("percent-encode it"), "{bad}: {message}");
        }
    }

    /// A host of the generated lists: a name, an IPv4 address or an IPv6 address.
    fn host() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z][a-z0-9-]{0,12}(\\.[a-z]{2,6}){0,2}",
            (0u8..=255, 0u8..=255, 0u8..=255, 1u8..=254).prop_map(|(a, b, c, d)| format!("{a}.{b}.{c}.{d}")),
            any::<u128>().prop_map(|bits| Ipv6Addr::from(bits).to_string()),
        ]
    }

    proptest! {
        #[test]
        fn parsed_hosts_and_ports_are_the_listed_ones(
            list in proptest::collection::vec((host(), proptest::option::of(1u16..=65535)), 1..5),
            password in "Pw[A-Z0-9]{8}",
            in_query in any::<bool>(),
            one_port in proptest::option::of(1u16..=65535),
        ) {
            let url = if in_query {
                // ?host=…&port=…: either one port for all, or one per host (empty for the default).
                let hosts: Vec<&str> = list.iter().map(|(h, _)| h.as_str()).collect();
                let ports = match one_port {
                    Some(port) => port.to_string(),
                    None => list
                        .iter()
                        .map(|(_, p)| p.map(|p| p.to_string()).unwrap_or_default())
                        .collect::<Vec<_>>()
                        .join(","),
                };
                format!("postgres://settler:{password}@/db?host={}&port={ports}&sslmode=prefer", hosts.join(","))
            } else {
                let authority: Vec<String> = list
                    .iter()
                    .map(|(h, p)| {
                        let h = if h.contains(':') { format!("[{h}]") } else { h.clone() };
                        p.map_or(h.clone(), |p| format!("{h}:{p}"))
                    })
                    .collect();
                format!("postgresql://settler:{password}@{}/db?target_session_attrs=read-write", authority.join(","))
            };
            let parsed = DatabaseUrl::parse(&url).map_err(|e| TestCaseError::fail(format!("{url}: {e}")))?;
            let expected: Vec<(String, u16)> = list
                .iter()
                .map(|(h, p)| {
                    let port = if in_query { one_port.or(*p) } else { *p };
                    (h.clone(), port.unwrap_or_else(default_port))
                })
                .collect();
            prop_assert_eq!(endpoints(&parsed), expected);
            prop_assert_eq!(parsed.connect_options().get_host(), list[0].0.as_str());
            for shown in [parsed.to_string(), format!("{parsed:?}"), redact::url(&url)] {
                prop_assert!(!shown.contains(&password), "{}", shown);
                prop_assert!(shown.contains("settler:***@"), "{}", shown);
            }
        }
    }
}
