# One image for every process of the gateway: the receiver, the relay, the Celery worker and the
# sweeper and the one-shot migration. compose.yaml picks the process with the command (see `idem --help`).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PORT=8000 \
    # Routes may name python actions in the project's folder (examples.actions:…).
    PYTHONPATH=/app

# A fixed, unprivileged uid/gid so volume permissions are predictable.
RUN groupadd --system --gid 10001 idem \
    && useradd --system --uid 10001 --gid idem --create-home --home-dir /home/idem \
       --shell /usr/sbin/nologin idem

WORKDIR /app
COPY . /app
# The files stay root-owned and read-only to the service user; only $HOME is writable.
RUN pip install --no-cache-dir . \
    && rm -rf /app/build /app/*.egg-info

USER idem

EXPOSE 8000

# No image HEALTHCHECK: the relay and the worker run from this image too and serve no HTTP.
# compose.yaml gives the receiver its own healthcheck on /healthz.
ENTRYPOINT ["idem"]
CMD ["serve", "--host", "0.0.0.0"]
