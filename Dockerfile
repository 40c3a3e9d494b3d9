# syntax=docker/dockerfile:1
# kube-cache-proxy container image: a static-enough Rust binary on distroless/cc (glibc and
# libgcc only: TLS is rustls with aws-lc-rs, compiled into the binary by its crate, no
# OpenSSL), running as the non-root user 65532.
#
#   docker build -t registry.example.com/kube-cache-proxy:0.1.0 .
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
# binary is copied out of the cached target directory before the mount goes away.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin kube-cache-proxy \
 && install -D -m 0755 target/release/kube-cache-proxy /out/kube-cache-proxy

# Runtime stage: no shell, no package manager; `nonroot` is uid/gid 65532.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/kube-cache-proxy /usr/local/bin/kube-cache-proxy
USER 65532:65532
EXPOSE 8443
ENTRYPOINT ["/usr/local/bin/kube-cache-proxy"]
CMD ["serve"]
