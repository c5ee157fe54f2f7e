# The sidecar that stands beside an engine (vLLM, SGLang): proxy, counting, policies, rules, alerting,
# history, status page. No torch, no transformers: the [model] extra (the embedded model, the probe,
# local re-tuning, the demo, SGLang recorder dumps) is not installed; re-tuning an engine's routers needs
# none of it.
#
#   docker build -t mla-watch:engine-side .
#   docker run -p 8000:8000 -v mla-watch-state:/state -v /models:/models:ro mla-watch:engine-side \
#       --upstream http://ENGINE:8001 --engine vllm --model-config /models/DeepSeek-V3/config.json
#
# The arguments given are added to `serve` on 0.0.0.0:8000 with /state (other commands: --entrypoint mla-watch).
FROM python:3.11-slim

# A user of its own: the state directory holds traffic (captured token ids) and the alert outbox.
RUN useradd --create-home --uid 10001 --user-group mla-watch \
    && mkdir /state && chown mla-watch:mla-watch /state && chmod 0700 /state

WORKDIR /opt/mla-watch
COPY pyproject.toml README.md ./
COPY mla_watch ./mla_watch
# EXTRAS="[model]" for what runs tensors (the SGLang recorder's .pt dumps); without a
# GPU in the sidecar, put the CPU build of torch first (see README.md): the default one is several GB.
ARG EXTRAS=""
RUN pip install --no-cache-dir ".${EXTRAS}" && rm -rf /opt/mla-watch

USER 10001:10001
WORKDIR /home/mla-watch
VOLUME ["/state"]
EXPOSE 8000
ENTRYPOINT ["mla-watch", "serve", "--host", "0.0.0.0", "--port", "8000", "--state-dir", "/state"]
