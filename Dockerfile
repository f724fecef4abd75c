# Multi-stage build of the newsnack binary.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked && strip target/release/newsnack

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* && useradd --system newsnack
COPY --from=build /src/target/release/newsnack /usr/local/bin/newsnack
USER newsnack
ENV NEWSNACK_LISTEN=0.0.0.0:8080
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s CMD curl -fsS http://127.0.0.1:8080/readyz || exit 1
ENTRYPOINT ["newsnack"]
CMD ["serve"]
