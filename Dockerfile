# One image for every process of the gateway: the receiver, the relay, the Celery worker, the
# sweeper and the one-shot migration. compose.yaml picks the process with the command (see `idem --help`).
# An exact Python release on a named Debian release, so a rebuild does not move to another
# minor version or distribution; add its digest (@sha256:…) where you build (docs/explanation/security.md).
FROM python:3.11.14-slim-bookworm

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

# Dependencies first, pinned by constraints.txt: this layer is rebuilt when the dependency list
# or the pins change, not on every change of the code. The runtime dependencies and the `otel`
# extra (tracing, off until OTEL_* variables are set); the other extras (embedded servers, test
# tools) stay out of the image.
COPY pyproject.toml constraints.txt /app/
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['otel']))" \
       > /tmp/requirements.txt \
    && pip install --no-cache-dir -c constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# Then the code, installed without resolving anything again.
COPY . /app
# The files stay root-owned and read-only to the service user; only $HOME and /tmp are writable.
RUN pip install -c constraints.txt --no-deps --no-cache-dir . \
    && rm -rf /app/build /app/*.egg-info

USER idem

EXPOSE 8000

# No image HEALTHCHECK: each process has its own probe, set in compose.yaml (the receiver's
# /readyz, the worker's broadcast ping, `idem alive` for the relay and the sweeper).
ENTRYPOINT ["idem"]
CMD ["serve", "--host", "0.0.0.0"]
