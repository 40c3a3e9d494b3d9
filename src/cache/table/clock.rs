//! The clock in a Table's cells: ages and durations as kube-apiserver prints them, the
//! timestamps they are printed from (an object's creation, a pod's containers' last
//! finishes, a Job's start and completion, a CronJob's last schedule), and the moment of
//! printing.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{BufMut, BytesMut};
use serde::Deserialize;

/// Go's `duration.HumanDuration` (k8s.io/apimachinery `util/duration`), of `d` in
/// milliseconds.
pub fn human_duration(d_ms: i64) -> String {
    // int(d.Seconds()) truncates toward zero.
    let seconds = d_ms / 1000;
    if seconds < -1 {
        return "<invalid>".into();
    }
    if seconds < 0 || d_ms < 0 {
        return "0s".into();
    }
    if seconds < 60 * 2 {
        return format!("{seconds}s");
    }
    let minutes = seconds / 60;
    if minutes < 10 {
        let s = seconds % 60;
        return if s == 0 {
            format!("{minutes}m")
        } else {
            format!("{minutes}m{s}s")
        };
    }
    if minutes < 60 * 3 {
        return format!("{minutes}m");
    }
    let hours = seconds / 3600;
    if hours < 8 {
        let m = minutes % 60;
        return if m == 0 {
            format!("{hours}h")
        } else {
            format!("{hours}h{m}m")
        };
    }
    if hours < 48 {
        return format!("{hours}h");
    }
    if hours < 24 * 8 {
        let h = hours % 24;
        return if h == 0 {
            format!("{}d", hours / 24)
        } else {
            format!("{}d{h}h", hours / 24)
        };
    }
    if hours < 24 * 365 * 2 {
        return format!("{}d", hours / 24);
    }
    if hours < 24 * 365 * 8 {
        let dy = (hours / 24) % 365;
        return if dy == 0 {
            format!("{}y", hours / 24 / 365)
        } else {
            format!("{}y{dy}d", hours / 24 / 365)
        };
    }
    format!("{}y", hours / 24 / 365)
}

/// Seconds since the epoch of a `metav1.Time` as the apiserver writes it
/// (`2006-01-02T15:04:05Z`, RFC 3339 in UTC); `None` for anything else.
pub fn parse_time(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() != 20 || b[10] != b'T' || b[19] != b'Z' {
        return None;
    }
    crate::k8s::go_format::rfc3339(s).map(|(secs, _)| secs)
}

/// Milliseconds since the epoch, now.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// An age cell as the apiserver encodes it (Go's JSON escapes `<` and `>`).
pub(super) fn put_age_cell(b: &mut BytesMut, created: Option<i64>, now_ms: i64) {
    match created {
        None => b.put_slice(br#""\u003cunknown\u003e""#),
        Some(c) => {
            let s = human_duration(now_ms - c * 1000);
            if s.starts_with('<') {
                b.put_slice(br#""\u003cinvalid\u003e""#);
            } else {
                b.put_u8(b'"');
                b.put_slice(s.as_bytes());
                b.put_u8(b'"');
            }
        }
    }
}

/// Splits a restarts cell's JSON `"N (X ago)"` into `N (` and `X`.
pub(super) fn split_restarts(cell: &str) -> Option<(&str, &str)> {
    let inner = cell.strip_prefix('"')?.strip_suffix(" ago)\"")?;
    let open = inner.find(" (")?;
    let (count, rest) = inner.split_at(open);
    if count.is_empty() || !count.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let printed = &rest[2..];
    if printed.is_empty() || printed.contains(['"', '\\', '(']) {
        return None;
    }
    Some((&inner[..open + 2], printed))
}

/// Every `lastState.terminated.finishedAt` of a pod's container and init container
/// statuses, seconds since the epoch; `None` when the pod cannot be read.
pub(super) fn pod_finished_times(pod: &[u8]) -> Option<Vec<i64>> {
    #[derive(Deserialize)]
    struct Pod {
        #[serde(default)]
        status: Status,
    }
    #[derive(Deserialize, Default)]
    #[serde(rename_all = "camelCase")]
    struct Status {
        #[serde(default)]
        container_statuses: Vec<ContainerStatus>,
        #[serde(default)]
        init_container_statuses: Vec<ContainerStatus>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct ContainerStatus {
        #[serde(default)]
        last_state: Option<LastState>,
    }
    #[derive(Deserialize)]
    struct LastState {
        #[serde(default)]
        terminated: Option<Terminated>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Terminated {
        #[serde(default)]
        finished_at: Option<String>,
    }
    let p: Pod = serde_json::from_slice(pod).ok()?;
    p.status
        .container_statuses
        .iter()
        .chain(&p.status.init_container_statuses)
        .filter_map(|c| {
            c.last_state
                .as_ref()?
                .terminated
                .as_ref()?
                .finished_at
                .as_deref()
        })
        .map(parse_time)
        .collect()
}

/// A Job's `status.startTime` and `status.completionTime`, seconds since the epoch; `None`
/// when the Job cannot be read (a time that does not parse included).
pub(super) fn job_times(job: &[u8]) -> Option<(Option<i64>, Option<i64>)> {
    #[derive(Deserialize)]
    struct Job {
        #[serde(default)]
        status: Status,
    }
    #[derive(Deserialize, Default)]
    #[serde(rename_all = "camelCase")]
    struct Status {
        #[serde(default)]
        start_time: Option<String>,
        #[serde(default)]
        completion_time: Option<String>,
    }
    let j: Job = serde_json::from_slice(job).ok()?;
    let time = |t: Option<String>| match t {
        Some(t) => parse_time(&t).map(Some),
        None => Some(None),
    };
    Some((time(j.status.start_time)?, time(j.status.completion_time)?))
}

/// A CronJob's `status.lastScheduleTime`, seconds since the epoch; `None` when the CronJob
/// cannot be read.
pub(super) fn last_schedule(cronjob: &[u8]) -> Option<Option<i64>> {
    #[derive(Deserialize)]
    struct CronJob {
        #[serde(default)]
        status: Status,
    }
    #[derive(Deserialize, Default)]
    #[serde(rename_all = "camelCase")]
    struct Status {
        #[serde(default)]
        last_schedule_time: Option<String>,
    }
    let c: CronJob = serde_json::from_slice(cronjob).ok()?;
    match c.status.last_schedule_time {
        Some(t) => parse_time(&t).map(Some),
        None => Some(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_durations_are_printed_as_apimachinery_prints_them() {
        let s = 1000;
        let m = 60 * s;
        let h = 60 * m;
        let d = 24 * h;
        let y = 365 * d;
        let table = [
            (-3 * s, "<invalid>"),
            (-2 * s, "<invalid>"),
            (-1500, "0s"),
            (-1, "0s"),
            (0, "0s"),
            (999, "0s"),
            (59 * s, "59s"),
            (119 * s, "119s"),
            (2 * m, "2m"),
            (2 * m + 5 * s, "2m5s"),
            (9 * m + 59 * s, "9m59s"),
            (10 * m + 30 * s, "10m"),
            (179 * m, "179m"),
            (3 * h, "3h"),
            (3 * h + 7 * m, "3h7m"),
            (8 * h + 30 * m, "8h"),
            (47 * h, "47h"),
            (2 * d, "2d"),
            (2 * d + 5 * h, "2d5h"),
            (8 * d + 5 * h, "8d"),
            (2 * y - d, "729d"),
            (2 * y, "2y"),
            (3 * y + 10 * d, "3y10d"),
            (8 * y + 10 * d, "8y"),
        ];
        for (ms, want) in table {
            assert_eq!(human_duration(ms), want, "{ms} ms");
        }
    }

    #[test]
    fn apiserver_timestamps_parse_to_epoch_seconds_and_others_do_not() {
        assert_eq!(parse_time("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_time("2026-12-07T11:00:07Z"), Some(1_796_641_207));
        assert_eq!(parse_time("2000-02-29T23:59:59Z"), Some(951_868_799));
        for bad in [
            "",
            "2026-12-07T11:00:07",
            "2026-12-07T11:00:07.5Z",
            "2026-12-07 11:00:07Z",
            "2026-13-07T11:00:07Z",
            "2026-12-07T11:00:07+01:00",
            "+026-12-07T11:00:07Z",
        ] {
            assert_eq!(parse_time(bad), None, "{bad:?}");
        }
    }
}
