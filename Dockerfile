# fine-settler: a static-ish release binary on a small non-root runtime image.
# The query data in .sqlx is committed, so the build needs no database (SQLX_OFFLINE=true), and the lock file is
# honoured (--locked). Only the product is built (-p fine-settler: not the model or the benchmark). Zone data is
# compiled in (chrono-tz), so the runtime image needs no tzdata.

FROM rust:1.95-bookworm AS build
WORKDIR /src
ENV SQLX_OFFLINE=true
COPY . .
RUN cargo build --release --locked -p fine-settler && strip target/release/fine-settler

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/fine-settler /usr/local/bin/fine-settler
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/fine-settler"]
CMD ["check-config"]
