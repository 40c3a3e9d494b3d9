//! The `kube-cache-proxy` binary; see the library docs for the design.

use clap::Parser;
use kube_cache_proxy::app::cli::{self, Cli, Command};

/// mimalloc returns freed memory to the system within milliseconds; glibc's malloc kept
/// about 1 GB of a burst of slow clients' buffers after they closed (the load driver's
/// `hostile-streams` scenario, docs/architecture.md, Memory bounds).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's collection of the calling thread's heap, called by idle runtime threads
/// (`app::memory::runtime` says why).
fn release_idle_memory() {
    // SAFETY: `mi_collect` has no preconditions: it only frees what the calling thread's
    // heap no longer uses (blocks other threads freed, empty pages) and may be called from
    // any thread at any time; mimalloc is this process's allocator.
    unsafe { libmimalloc_sys::mi_collect(false) }
}

/// mimalloc's `mi_option_purge_delay` (its v3 `mi_option_e`, which `libmimalloc-sys` does
/// not name).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// The allocator's settings (`app::memory::purge_delay_ms` says why).
fn configure_allocator() {
    if let Some(ms) = kube_cache_proxy::app::memory::purge_delay_ms() {
        // SAFETY: setting an option has no preconditions; mimalloc reads it when it next
        // schedules a purge.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, ms as _) }
    }
}

fn main() {
    configure_allocator();
    // Before the process allocates much (`app::memory` says why).
    if let Err(e) = kube_cache_proxy::app::memory::disable_transparent_huge_pages() {
        eprintln!("warning: transparent huge pages stay on: {e}");
    }
    let rt = match kube_cache_proxy::app::memory::runtime(release_idle_memory) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the runtime: {e}");
            std::process::exit(1);
        }
    };
    rt.block_on(async_main());
}

async fn async_main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli).await {
        // One line: the error and its causes, each once (no Debug dump, no backtrace: these
        // are configuration and environment errors, not bugs).
        let chain: Vec<&(dyn std::error::Error + 'static)> = e.chain().collect();
        eprintln!(
            "error: {}",
            kube_cache_proxy::upstream::error_chain(chain[0])
        );
        std::process::exit(1);
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::CheckConfig(args) => {
            let errs = cli::check_config(&args).await;
            let file = args.file.display();
            if errs.is_empty() {
                println!("{file}: ok");
                Ok(())
            } else {
                eprintln!("{file}: {} error(s)", errs.len());
                for e in &errs {
                    eprintln!("{file}: {e}");
                }
                std::process::exit(1);
            }
        }
        Command::Serve(args) => {
            let cfg = match args.resolve() {
                Ok(c) => c,
                Err(e) => {
                    eprintln!(
                        "invalid configuration: {}",
                        kube_cache_proxy::upstream::error_chain(&e)
                    );
                    std::process::exit(1);
                }
            };
            cli::init_logging(
                &cfg.log.level,
                cfg.log.format,
                cfg.log.access_flush_interval,
            );
            kube_cache_proxy::http::tls::install_crypto_provider();
            let kube = kube_cache_proxy::upstream::load_kube_config(&cfg.upstream).await?;
            tracing::info!(upstream = %kube.cluster_url, "starting");
            let running = kube_cache_proxy::app::start::start(cfg, &kube).await?;
            cli::termination_signal().await;
            running.shutdown().await;
            cli::flush_logs();
            Ok(())
        }
        #[cfg(feature = "dev")]
        Command::Dev(args) => cli::dev(args).await,
    }
}
