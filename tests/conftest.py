import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# The CPU tiers (unit, dist, e2e, cluster) are CPU tests on every machine. With `backend.device=auto` their runs
# would land on a GPU machine's GPUs: two workers refused on one GPU, nccl for gloo, CUDA memory metrics for RSS,
# GPU kernels where the tests compare bit for bit. So the session hides the GPUs, from itself and from every
# process it starts (set here, before anything in this process can initialise CUDA; bitsandbytes' import does),
# and the GPU tier (tests/gpu) hands them back to its own runs only: `use_gpus`, `gpu_env`, `gpu_count`.
# Launchers that set CUDA_VISIBLE_DEVICES themselves (DeepSpeed's) or log in over ssh (which does not carry it)
# are given `backend.device=cpu` (and DeepSpeed's CPU accelerator) by the tests that use them.
REAL_CUDA_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# Under pytest-xdist the cores are the workers' to share: each worker's runs get their share of intra-op threads
# (OMP_NUM_THREADS, set before torch loads here; read by the launcher, the workers and the rank pools). Runs that
# each assumed the whole machine put 2 OpenMP threads per process on a core another worker was using: every
# thread of a parallel region then waits at its barrier for one that is not running (a step 3-10x slower).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

from shardyard.testing import TINY, run_python  # noqa: E402,F401  (TINY is re-exported to the tests)

# DeepSpeed's compiled ops: every process of the session (this one, the workers, every rank and run they start)
# builds and loads them in this install's own root (``op_builds.venv_build_root``), where `make setup` compiled
# them. A test that loads an op itself (DeepSpeedCPUAdam, the async I/O handle) never passes through the engine's
# ``check_deepspeed_ops``, which sets it: without this it compiled cpu_adam, pin_memory and async_io a second
# time in torch's shared default root, about 6 minutes of the suite (seen on a fresh machine, 2026-11-29).
from shardyard.core.op_builds import venv_build_root  # noqa: E402

venv_build_root()


def train_py(*overrides: str, run_dir: Path, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python train.py`` as a user would, in its own run dir: forked from a server that has imported torch
    and transformers once (``shardyard.testing.run_python``), or a cold interpreter with SHARDYARD_TEST_COLD=1."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return run_python([str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *overrides], str(ROOT), full_env, timeout)


def shardyard_cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """``python -m shardyard ARGS`` in the checkout, forked warm as ``train_py``: a script that runs the package's
    ``__main__`` as ``-m`` does (runpy), so the same CLI code runs. A warning printed at import time is the fork
    server's, not seen here."""
    import tempfile

    shim = Path(tempfile.gettempdir()) / f"shardyard-python-m-{os.getpid()}.py"
    if not shim.exists():
        shim.write_text('import runpy\n\nrunpy.run_module("shardyard", run_name="__main__", alter_sys=True)\n')
    return run_python([str(shim), *args], str(ROOT), {**os.environ, "PYTHONUNBUFFERED": "1"}, timeout)


def gpu_env() -> dict:
    """This session's environment with the machine's own CUDA_VISIBLE_DEVICES: what the GPU tier's runs see."""
    env = dict(os.environ)
    if REAL_CUDA_VISIBLE_DEVICES is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = REAL_CUDA_VISIBLE_DEVICES
    return env


NO_GPU = "no GPU on this machine"
"""The GPU tier's one skip for a machine: no driver reports a GPU (``driver_gpus``)."""
CAPABILITY = "capability: "
"""The prefix of the GPU tier's other allowed skip: a capability these GPUs lack, named (``capability()``)."""


def capability(what: str) -> str:
    """A GPU-tier skip reason the session allows: these GPUs lack ``what`` (e.g. float8 matmuls below 8.9)."""
    return CAPABILITY + what


def driver_gpus() -> tuple[int, str]:
    """The GPUs the NVIDIA driver reports, asked without torch, and how it was asked: ``nvidia-smi -L`` (on PATH),
    else the entries of /proc/driver/nvidia/gpus/ where /dev/nvidiactl exists. ``SHARDYARD_TEST_DRIVER_GPUS=N`` stands in for the driver
    (tests/unit/test_gpu_tier_probe.py fakes a GPU with it); ``SHARDYARD_TEST_DRIVER_PROC`` for the /proc path."""
    fake = os.environ.get("SHARDYARD_TEST_DRIVER_GPUS")
    if fake is not None:
        return int(fake), f"SHARDYARD_TEST_DRIVER_GPUS={fake}"
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
        listed = [line for line in out.splitlines() if line.startswith("GPU ")]
        if listed:
            return len(listed), f"nvidia-smi -L lists {len(listed)}"
    except (OSError, subprocess.SubprocessError):
        pass
    proc = Path(os.environ.get("SHARDYARD_TEST_DRIVER_PROC", "/proc/driver/nvidia/gpus"))
    if "SHARDYARD_TEST_DRIVER_PROC" not in os.environ and not os.path.exists("/dev/nvidiactl"):
        return 0, "no /dev/nvidiactl"  # a container on a GPU host sees the host's /proc, without its GPUs: a CPU machine
    entries = list(proc.iterdir()) if proc.is_dir() else []
    return len(entries), f"{proc} has {len(entries)}"


@functools.lru_cache(maxsize=None)
def torch_gpus() -> tuple[int, str | None]:
    """The GPUs the GPU tier's runs see through torch, counted by a fresh interpreter (this process keeps CUDA
    hidden and uninitialised), and why none when none: a CPU build of torch, a failed CUDA initialisation (its
    error), or ``device_count() == 0``."""
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return 0, f"torch {torch.__version__} is a CPU build (no CUDA)"
    code = "import torch; torch.cuda.init(); print(torch.cuda.device_count())"
    proc = subprocess.run([sys.executable, "-c", code], env=gpu_env(), capture_output=True, text=True, timeout=300)
    lines = proc.stdout.split()
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return 0, f"CUDA does not initialise in torch {torch.__version__}: {tail}"
    n = int(lines[-1])
    return n, None if n else f"torch {torch.__version__}: torch.cuda.device_count() is 0"


@functools.lru_cache(maxsize=None)
def gpu_tier() -> tuple[int, str | None]:
    """(the GPUs the tier's runs use, why the tier must FAIL or None). No driver GPU: (0, None), the tier skips
    with NO_GPU. A driver that reports GPUs torch cannot use is a broken machine, not a CPU one: the tier fails
    with the reason (a CPU build of torch, CUDA's init error, none counted), so CI cannot pass on it by
    skipping."""
    listed, how = driver_gpus()
    if listed == 0:
        return 0, None
    n, why = torch_gpus()
    if n == 0:
        return 0, f"the driver reports {listed} GPU(s) ({how}) but torch cannot use them: {why}"
    return n, None


def gpu_count() -> int:
    """The GPUs the GPU tier's runs see (0 without a driver GPU, or when torch cannot use them: ``gpu_tier``)."""
    return gpu_tier()[0]


def need_gpus() -> int:
    """For a GPU test outside tests/gpu: the GPU count, a skip with NO_GPU, or a failure with ``gpu_tier``'s
    reason when the driver reports GPUs that torch cannot use."""
    n, broken = gpu_tier()
    if broken:
        pytest.fail(broken, pytrace=False)
    if n == 0:
        pytest.skip(NO_GPU)
    return n


def use_gpus(monkeypatch) -> None:
    """For the GPU tier: its runs see the GPUs again, and each ``python train.py`` is a fresh interpreter (the
    fork server started with the GPUs hidden, and a CUDA context must never exist before a fork)."""
    if REAL_CUDA_VISIBLE_DEVICES is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", REAL_CUDA_VISIBLE_DEVICES)
    monkeypatch.setenv("SHARDYARD_TEST_COLD", "1")


def pytest_report_header(config):
    n, broken = gpu_tier()
    if broken:
        return f"GPU tier: FAILS: {broken}"
    if n == 0:
        return f"GPU tier: {NO_GPU} (tests/gpu skip); the other tiers run on CPU"
    return (f"GPU tier: {n} visible GPU(s), every engine runs at world {n}"
            + (" (FSDP and ZeRO shard over that one rank; fsdp_tp, pipeline and expert parallelism need 2+)"
               if n == 1 else "")
            + "; the other tiers run on CPU (CUDA_VISIBLE_DEVICES hidden)")


CLUSTER_STEPS = [*TINY, "train.steps=5", "train.eval_every_n_steps=0", "train.global_batch_size=8",
                 "backend.device=cpu"]
"""The cluster tier's recipe: 5 steps of the tiny model at a global batch of 8, on CPU (``backend.device=cpu``:
workers started over ssh, by DeepSpeed's launcher or by Slurm may see a GPU machine's GPUs). Every cluster run of
an engine (namespace hosts, Slurm) must match the 1-host run of it."""


@pytest.fixture(scope="session")
def one_host(tmp_path_factory):
    """The single-host 2-worker run of an engine on CLUSTER_STEPS (plus any overrides), made once per session
    on first use: ``one_host("ddp")`` or ``one_host("ddp", "train.steps=40")`` -> its train losses."""
    import json

    runs: dict = {}

    def get(engine, *extra):
        if (engine, extra) not in runs:
            d = tmp_path_factory.mktemp(f"one-{engine}")
            proc = train_py(*CLUSTER_STEPS, f"backend={engine}", *extra, "launch.nproc_per_node=2", run_dir=d)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            runs[engine, extra] = [v for _, v in json.load(open(d / "summary.json"))["train_losses"]]
        return runs[engine, extra]
    return get


# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadscope`, with the scopes below): most
# of a test's time is one process at a time (a single-process run, a dry run's parent, a rank waiting on its peer,
# an interpreter importing torch), so a second worker fills the other core. What must stay on one worker is one
# scope: a module with a module-scoped fixture (a trained run, a pool of jobs) runs whole on one worker, so the
# fixture is built once; the cluster tier (its namespace hosts, its Slurm, the session's `one_host` runs) is one
# scope. Every other test is its own. (Decided from the test's file, as the controller sees only test ids; and
# not with xdist_group marks: xdist 3.8 writes them into `item._nodeid`, which pytest 9 no longer reads:
# pytest-dev/pytest-xdist#1386.)
@functools.lru_cache(maxsize=None)
def _module_fixtures(path: str) -> bool:
    return 'scope="module"' in (ROOT / path).read_text()


def _scope(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    if path.startswith("tests/cluster/"):
        return "tests/cluster"
    return path if _module_fixtures(path) else nodeid


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Scoped(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return Scoped(config, log)


# CI cannot pass by skipping: a test outside the GPU tier (tests/gpu, marker `gpu`) that skips fails the
# session, after a list of them and why. Every requirement of those tests is installed by `make test`
# (scripts/cluster_deps.sh as root, scripts/setup.sh), so a skip means a tier silently did not run.
# SHARDYARD_ALLOW_SKIPS=1 lets a developer without root (or with SHARDYARD_SKIP_HOROVOD=1) pass anyway.
# The GPU tier's skips are listed too, with their reasons; two reasons are allowed (NO_GPU, and a named
# CAPABILITY the GPUs lack), any other fails the session whatever SHARDYARD_ALLOW_SKIPS says.
_SKIPPED: list[tuple[str, str]] = []
_GPU_SKIPPED: list[tuple[str, str]] = []


def _gpu_tier(report) -> bool:
    return report.nodeid.startswith("tests/gpu/") or "gpu" in getattr(report, "keywords", {})


def _skip_reason(report) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


def _gpu_skip_allowed(reason: str) -> bool:
    return reason == NO_GPU or reason.startswith(CAPABILITY)


# CI's log keeps only its tail, and a session cut at CI's limit prints no --durations: the controller writes a line
# for every phase of a test that took SLOW_S or more or failed, with the session's clock, so the tail shows where
# the time went (and, against CI's limit, how long the setup before pytest took).
SLOW_S = float(os.environ.get("SHARDYARD_TEST_SLOW_S", "60"))
_CLOCK: dict = {}


def pytest_configure(config):
    _CLOCK["start"], _CLOCK["config"] = time.monotonic(), config


def _clock_line(report) -> None:
    config = _CLOCK.get("config")
    if config is None or hasattr(config, "workerinput") or not (report.failed or report.duration >= SLOW_S):
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        ci = os.environ.get("SHARDYARD_CI_START")  # .ci/run's start (epoch seconds): the setup's time shows too
        since = f", CI t+{time.time() - float(ci):.0f}s" if ci else ""
        reporter.write_line(f"    [session t+{time.monotonic() - _CLOCK['start']:.0f}s{since}] {report.when} of "
                            f"{report.nodeid}: {report.duration:.0f}s" + (" FAILED" if report.failed else ""))


def pytest_runtest_logreport(report):
    _clock_line(report)
    if report.skipped and not hasattr(report, "wasxfail"):
        (_GPU_SKIPPED if _gpu_tier(report) else _SKIPPED).append((report.nodeid, _skip_reason(report)))


def pytest_collectreport(report):  # a module-level skip (pytest.importorskip at import) skips at collection
    if report.skipped:
        (_GPU_SKIPPED if _gpu_tier(report) else _SKIPPED).append((report.nodeid, _skip_reason(report)))


def pytest_sessionfinish(session, exitstatus):
    bad_gpu = any(not _gpu_skip_allowed(reason) for _, reason in _GPU_SKIPPED)
    if exitstatus == 0 and (bad_gpu or _SKIPPED and os.environ.get("SHARDYARD_ALLOW_SKIPS") != "1"):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _GPU_SKIPPED:
        bad = [(nodeid, reason) for nodeid, reason in _GPU_SKIPPED if not _gpu_skip_allowed(reason)]
        terminalreporter.section("skipped in the GPU tier" + (": the session fails" if bad else ""), sep="=",
                                 red=bool(bad))
        reasons: dict[str, list[str]] = {}
        for nodeid, reason in _GPU_SKIPPED:
            reasons.setdefault(reason, []).append(nodeid)
        for reason, ids in reasons.items():
            verdict = "allowed" if _gpu_skip_allowed(reason) else f"NOT allowed (only {NO_GPU!r} or {CAPABILITY}...)"
            terminalreporter.line(f"{len(ids)} skipped, {verdict}: {reason}")
            if reason != NO_GPU:  # the capability and the refused ones, by test
                for nodeid in ids:
                    terminalreporter.line(f"  {nodeid}")
    if not _SKIPPED:
        return
    allowed = os.environ.get("SHARDYARD_ALLOW_SKIPS") == "1"
    terminalreporter.section("skipped outside the GPU tier" + (" (allowed: SHARDYARD_ALLOW_SKIPS=1)" if allowed
                                                                else ": the session fails"), sep="=", red=not allowed)
    for nodeid, reason in _SKIPPED:
        terminalreporter.line(f"{nodeid}: {reason}")
    if not allowed:
        terminalreporter.line("Each needs what `make test` installs (as root). Install it, or set "
                              "SHARDYARD_ALLOW_SKIPS=1 to let this machine pass without it.")


def byte_bpe(text: str, eos: str = "<|endoftext|>"):
    """A small byte-level BPE tokenizer (vocab 300) trained on ``text``, ``eos`` its end-of-text and pad token: the
    post-training data tests' tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator([text] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token=eos, pad_token=eos)


class Whole:
    """The replica engines' side of ``export.save_hf`` (rank 0 holds the model): a real model and its state."""

    rank, world_size = 0, 1

    def __init__(self, model):
        self.model = model

    def hf_model(self):
        return self.model

    def full_state_dict(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def loglikelihood_task(tasks: Path, name: str, rows: list[dict], tag: str | None = None) -> None:
    """A local lm-eval task ``name`` in ``tasks/``: ``rows`` (``q`` the context, ``t`` the continuation) scored by
    perplexity of the continuation, with an optional ``tag``."""
    import json

    tasks.mkdir(exist_ok=True)
    (tasks / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks}/{name}.jsonl\n"
        "output_type: loglikelihood\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{t}}'\n"
        "target_delimiter: ''\nmetric_list:\n  - metric: perplexity\nmetadata:\n  version: 1\n"
        + (f"tag: {tag}\n" if tag else ""))


def generation_ends_at_the_tokenizers_eos(hf_dir) -> None:
    """An export (``hf_dir``) read by transformers alone (``AutoModelForCausalLM.from_pretrained``, its
    ``generate`` reading ``generation_config.json``) ends a greedy completion exactly where its tokenizer's end
    token comes, and at no token before it: the model is made to produce a script (a logits processor masks every
    other token) of 40 tokens the tokenizer does not call special, among them 0, 1 and 2 where they are not
    (transformers' default bos and eos of the LLaMA, DeepSeek-V2 and DeepSeek-V3 configs), then the eos, then 3
    more. And every id the export's generation config ends at is one the tokenizer calls special."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    ends = model.generation_config.eos_token_id
    ends = set(ends) if isinstance(ends, (list, tuple)) else {ends}
    assert ends <= special and tok.eos_token_id in ends, (ends, special, tok.eos_token_id)
    g = torch.Generator().manual_seed(0)
    ordinary = [i for i in range(len(tok)) if i not in special]
    defaults = [i for i in (0, 1, 2) if i not in special]
    script = [ordinary[int(j)] for j in torch.randint(len(ordinary), (40 - len(defaults),), generator=g)]
    script[5:5] = defaults  # not first: an end at the very first token would hide the others
    script += [tok.eos_token_id] + script[:3]
    prompt = torch.tensor([ordinary[:5]])

    class Script(LogitsProcessor):
        def __call__(self, input_ids, scores):
            forced = torch.full_like(scores, -float("inf"))
            forced[:, script[input_ids.shape[1] - prompt.shape[1]]] = 0.0
            return forced

    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=len(script),
                             do_sample=False, logits_processor=[Script()])
    got = out[0, prompt.shape[1]:].tolist()
    assert got == script[:41], f"generation ended after {len(got)} of the 41 tokens up to the eos, at {got[-1]}"
