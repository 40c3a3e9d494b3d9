//! Stamps the source revision into the binary (`kube_cache_proxy_build_info`):
//! `KUBE_CACHE_PROXY_REVISION` if set (image builds without `.git`), else `git rev-parse
//! HEAD`, else `unknown` (a tarball without git history must still build).

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

/// Reruns the script when `path` changes; only for files that exist (cargo reruns a script
/// every build while a watched file is missing).
fn watch(path: Option<String>) {
    if let Some(p) = path.filter(|p| std::path::Path::new(p).exists()) {
        println!("cargo:rerun-if-changed={p}");
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=KUBE_CACHE_PROXY_REVISION");
    let revision = match std::env::var("KUBE_CACHE_PROXY_REVISION") {
        Ok(r) if !r.is_empty() => r,
        _ => {
            // Rebuild when HEAD moves: HEAD itself (a checkout) and the branch it names (a
            // commit), wherever this checkout keeps them (worktrees included).
            for path in [
                Some("HEAD".to_string()),
                git(&["symbolic-ref", "-q", "HEAD"]),
            ]
            .into_iter()
            .flatten()
            {
                watch(git(&["rev-parse", "--git-path", &path]));
            }
            watch(git(&["rev-parse", "--git-path", "packed-refs"]));
            git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into())
        }
    };
    println!("cargo:rustc-env=KUBE_CACHE_PROXY_REVISION={revision}");
}
