# syntax=docker/dockerfile:1
# kube-cache-proxy container image: a static-enough Rust binary on distroless/cc (glibc and
# libgcc only: TLS is rustls with aws-lc-rs, compiled into the binary by its crate, no
# OpenSSL), running as the non-root user 65532.
#
#   docker build --build-arg KUBE_CACHE_PROXY_REVISION=$(git rev-parse HEAD) \
#     -t registry.example.com/kube-cache-proxy:0.1.0 .
#
# The revision is stamped into the binary (`--version`, kube_cache_proxy_build_info) and the
# image label org.opencontainers.image.revision; .git stays out of the build context
# (.dockerignore), so without the argument both say `unknown`.
#
# The Deployment in deploy/ runs it as `kube-cache-proxy serve --config ...` with a read-only
# root file system; the image needs no writable path.

# Build stage: the toolchain matches Cargo.toml's edition and rust-version (1.90 or newer).
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# The source revision in kube_cache_proxy_build_info: `--build-arg
# KUBE_CACHE_PROXY_REVISION=$(git rev-parse HEAD)` when the context has no .git (build.rs
# asks git otherwise, and says `unknown` without either).
ARG KUBE_CACHE_PROXY_REVISION=
# BuildKit cache mounts keep the registry and the target directory between builds; the
# binary is copied out of the cached target directory before the mount goes away, without
# its debug information (the release profile's line tables: 148 MB with them, 31 MB
# without; the symbol table stays, so a panic's backtrace still names its functions).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    if [ -z "$KUBE_CACHE_PROXY_REVISION" ]; then \
      echo "warning: no --build-arg KUBE_CACHE_PROXY_REVISION: the revision is 'unknown'" >&2; \
    fi \
 && cargo build --release --locked --bin kube-cache-proxy \
 && install -D -m 0755 target/release/kube-cache-proxy /out/kube-cache-proxy \
 && objcopy --strip-debug /out/kube-cache-proxy

# Runtime stage: no shell, no package manager; `nonroot` is uid/gid 65532.
FROM gcr.io/distroless/cc-debian12:nonroot
ARG KUBE_CACHE_PROXY_REVISION=
LABEL org.opencontainers.image.revision="${KUBE_CACHE_PROXY_REVISION:-unknown}"
COPY --from=build /out/kube-cache-proxy /usr/local/bin/kube-cache-proxy
USER 65532:65532
EXPOSE 8443
ENTRYPOINT ["/usr/local/bin/kube-cache-proxy"]
CMD ["serve"]
