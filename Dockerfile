# Multi-stage build of the newsnack binary.
#
# The image runs as user and group 10001, numeric so that Kubernetes can
# check `runAsNonRoot`, with nothing to write: the binary writes no file
# (logs go to stdout, state to PostgreSQL), so the root filesystem may be
# mounted read-only (deploy/kubernetes) and no volume is needed. /bin/sh
# stays for the Kubernetes preStop hook (`kill -USR1 1 && sleep 5`).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked && strip target/release/newsnack

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 newsnack \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin newsnack
COPY --from=build /src/target/release/newsnack /usr/local/bin/newsnack
USER 10001:10001
ENV NEWSNACK_LISTEN=0.0.0.0:8080
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s CMD curl -fsS http://127.0.0.1:8080/readyz || exit 1
# Exec form: newsnack is PID 1 and gets SIGTERM and SIGUSR1 itself.
ENTRYPOINT ["newsnack"]
CMD ["serve"]
