# MinIO for compose on a machine that cannot pull the public `minio/minio` image: the minio
# binary scripts/setup.sh builds with its pinned `go install` (MINIO_VERSION there) on a Debian
# base. The build context is a folder holding that binary as `minio`; tests/compose/docker_env.py
# prepares it and docker-compose.yml picks the image through STRATA_MINIO_IMAGE.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
# wget: the compose health check falls back to GET /minio/health/ready where `mc` is absent
RUN command -v wget >/dev/null || (apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*)
COPY minio /usr/local/bin/minio
EXPOSE 9000 9001
ENTRYPOINT ["minio"]
