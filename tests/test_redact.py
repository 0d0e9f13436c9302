"""Secrets in what the launcher prints (dsclient.launcher._redact): pure, no process."""

from __future__ import annotations

from dsclient.launcher._command import LaunchPlan
from dsclient.launcher._redact import is_secret_name, redact_argv, scrub, secrets_in


def test_secrets_never_show_in_the_printed_command_or_the_repr():
    argv = ("python", "-m", "vllm", "--api-key", "sk-secret-123", "--hf-token=hf_abcdef", "-x")
    plan = LaunchPlan(
        argv=argv,
        env={"VLLM_SERVER_DEV_MODE": "0", "HF_TOKEN": "hf_envsecret"},
        url="http://127.0.0.1:8000",
        served_model_name="tiny",
        max_num_seqs=8,
        max_model_len=2048,
        profile="cpu",
    )
    for text in (plan.shell(), repr(plan)):
        assert "sk-secret-123" not in text and "hf_abcdef" not in text
        assert "hf_envsecret" not in text
    assert "--api-key '***'" in plan.shell() or "--api-key ***" in plan.shell()
    assert "VLLM_SERVER_DEV_MODE=0" in plan.shell()
    assert redact_argv(argv)[3:6] == ("--api-key", "***", "--hf-token=***")
    secrets = secrets_in(argv, plan.env)
    assert set(secrets) == {"sk-secret-123", "hf_abcdef", "hf_envsecret"}
    echoed = "error: unrecognized arguments: --api-kee sk-secret-123"
    assert scrub(echoed, secrets) == "error: unrecognized arguments: --api-kee ***"
    assert redact_argv(["--api-key"]) == ("--api-key",)  # a dangling flag is left as it is


def test_secret_names_and_short_values():
    assert is_secret_name("HF_TOKEN") and is_secret_name("openai_api_key")
    assert not is_secret_name("VLLM_CPU_KVCACHE_SPACE")
    # Values under 4 characters are not scrubbed: "***" for every "1" would garble a log.
    assert secrets_in(["--api-key", "abc"], {"MY_KEY": ""}) == []
