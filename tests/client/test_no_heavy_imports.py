"""The client and its CLI run where torch, transformers and ray cannot be imported."""

from __future__ import annotations


def test_client_imports_and_works_without_heavy_packages(run_without_heavy_packages):
    result = run_without_heavy_packages(
        """
        try:
            import torch
        except ImportError:
            pass
        else:
            raise SystemExit("the blocker let torch through")
        import opentinker.client
        from opentinker.client import OpenTinkerClient, JobHandle, GenericEnvironment, InteractionSpec
        from opentinker.client import cli
        env = GenericEnvironment({"algorithm.adv_estimator": "rloo"},
                                 [InteractionSpec(name="g", class_path="gym", config={"env_endpoint": "http://h:1"})],
                                 data_generator=(lambda i: {"extra_info": {"interaction_kwargs": {"name": "g"}}}, 16))
        assert len(list(env.get_dataloader())) == 2
        from opentinker.client import plot, quickstart  # matplotlib only when a curve is drawn
        heavy = sorted(
            m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "ray", "vllm", "matplotlib")
        )
        assert not heavy, heavy
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_cli_help_runs_without_heavy_packages(run_without_heavy_packages):
    result = run_without_heavy_packages(
        """
        import runpy
        sys.argv = ["opentinker", "--help"]
        runpy.run_module("opentinker.client.cli", run_name="__main__")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "usage: opentinker" in result.stdout and "jobs" in result.stdout
