"""Prepared data in object storage (issue 29, item 6), against a real S3-compatible server on 127.0.0.1.

moto's server mode runs as a separate process with authentication on: an IAM user and its keys are made through
its API, and a request signed with other keys is refused, as by AWS. The credentials and the endpoint reach
`lrattn` only through the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL).
`prepare --out s3://...` uploads what a local prepare writes (meta.json last); `fit --data.data_dir s3://...`
trains from it, and a run stopped by SIGTERM resumes at the same batch: its losses equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.runs import REGISTRY, assert_same_losses, fit_args, hooks, metric_history, run_process, the_run

from lrattn_lightning.cli import main
from lrattn_lightning.data import remote
from lrattn_lightning.data.prepare import prepare
from lrattn_lightning.data.shards import read_meta

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A moto S3 server on 127.0.0.1 requiring signed requests; yields the environment of a user allowed to use
    the bucket `lrattn-data` (and the endpoint)."""
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("moto")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("moto") / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"},  # the 3 set-up calls below
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="setup",
                           aws_secret_access_key="setup")
        iam.create_user(UserName="researcher")
        iam.put_user_policy(UserName="researcher", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="researcher")["AccessKey"]
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
               "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"], "AWS_DEFAULT_REGION": "us-east-1"}
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket="lrattn-data")
        yield env
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def s3_env(server, monkeypatch, tmp_path):
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {**server, "LRATTN_CACHE_DIR": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    return {**server, "LRATTN_CACHE_DIR": str(tmp_path / "cache")}


def one_line(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("lrattn:")]


def objects(prefix: str) -> dict[str, int]:
    return remote.sizes(f"s3://lrattn-data/{prefix}")


ARGS = ["prepare", "--source", "stdlib-docs", "--max_documents", "60", "--val_fraction", "0.1"]


def test_prepare_to_s3_uploads_what_a_local_prepare_writes(s3_env, tmp_path, capsys):
    assert main([*ARGS, "--out", "s3://lrattn-data/corpora/stdlib"]) == 0
    local = tmp_path / "local"
    assert main([*ARGS, "--out", str(local)]) == 0
    uploaded = objects("corpora/stdlib")
    written = {p.relative_to(local).as_posix(): p.stat().st_size for p in local.rglob("*") if p.is_file()}
    assert set(uploaded) == set(written)
    meta, here = read_meta("s3://lrattn-data/corpora/stdlib"), read_meta(local)
    for split in ("train", "val"):  # the same shards (index.json differs only by its timestamp)
        assert {n: r for n, r in meta["checksums"][split].items() if n != "index.json"} == \
               {n: r for n, r in here["checksums"][split].items() if n != "index.json"}
    assert meta["splits"] == here["splits"]
    assert not any((tmp_path / "cache" / "upload").iterdir())  # the upload's staging folder is gone
    capsys.readouterr()
    assert main([*ARGS, "--out", "s3://lrattn-data/corpora/stdlib"]) == 2
    assert one_line(capsys) == ["lrattn: error: --out s3://lrattn-data/corpora/stdlib already holds a prepared folder; "
                                "pass --overwrite to replace it, or choose another --out"]


def test_wrong_bucket_credentials_or_prefix_is_one_line(s3_env, tmp_path, monkeypatch, capsys):
    fit = ["fit", "--size", "tiny", "--ablation", "baseline", "--registry", REGISTRY, "--trainer.max_steps", "2"]
    cases = [
        ([*ARGS, "--out", "s3://no-such-bucket/x"], {}, "s3://no-such-bucket/x: bucket 'no-such-bucket' does not exist"),
        ([*fit, "--data.data_dir", "s3://no-such-bucket/x"], {}, "bucket 'no-such-bucket' does not exist"),
        ([*fit, "--data.data_dir", "s3://lrattn-data/nothing-here"], {},
         "s3://lrattn-data/nothing-here/meta.json does not exist, so s3://lrattn-data/nothing-here is not a prepared "
         "data dir; write one with `lrattn prepare --out s3://lrattn-data/nothing-here`"),
        ([*ARGS, "--out", "s3://lrattn-data/x"], {"AWS_SECRET_ACCESS_KEY": "wrong"},
         "refused the credentials (403); check AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY"),
        ([*fit, "--data.data_dir", "s3://lrattn-data/x"], {"AWS_ACCESS_KEY_ID": "AKIAUNKNOWN"},
         "refused the credentials (403); check AWS_ACCESS_KEY_ID"),
    ]
    for args, env, needle in cases:
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            code = main(args)
        lines = one_line(capsys)
        assert code == 2 and len(lines) == 1 and needle in lines[0], (args, lines)
    assert sorted(p.name for p in tmp_path.iterdir()) in (["cache"], [])  # no run, no store, no staging
    assert not any((tmp_path / "cache" / "upload").glob("*/*"))


@pytest.mark.usefixtures("mlflow_store")
def test_fit_from_s3_resumes_at_the_same_batch(s3_env, tmp_path, capsys):
    """A run on s3:// data stopped by SIGTERM (a real process) resumes, in this process, to the losses of an
    uninterrupted run: the data position came back with the checkpoint."""
    url = "s3://lrattn-data/corpora/fit"
    prepare("stdlib-docs", url, max_documents=60, val_fraction=0.1, cloze_items=0, perplexity_documents=0)
    steps = 4
    stopped = run_process(fit_args(url, "--experiment", "stopped", "--config",
                                   hooks(tmp_path, "term.yaml", ("SigtermAtStep", {"step": 1})), steps=steps),
                          tmp_path, **s3_env)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "lrattn: stopped by SIGTERM at step 2" in stopped.stderr
    assert main(fit_args(url, "--experiment", "stopped", "--ckpt_path", "last", steps=steps)) == 0
    assert main(fit_args(url, "--experiment", "full", steps=steps)) == 0
    client, resumed = the_run(tmp_path, "stopped")
    _, full = the_run(tmp_path, "full")
    a, b = metric_history(client, resumed.info.run_id), metric_history(client, full.info.run_id)
    assert [s for s, _ in a] == list(range(steps))
    assert_same_losses(a, b)
    import torch

    ckpt = torch.load(tmp_path / "runs/stopped/tiny-baseline-seed0/checkpoints/last.ckpt", weights_only=True)
    assert ckpt["data"]["data_dir"] == url and ckpt["tokenizer"] == {"kind": "byte"}
    assert any((tmp_path / "cache" / "s3" / "lrattn-data" / "corpora" / "fit").glob("chunks/train/**/chunk-0-0.bin"))
    capsys.readouterr()  # the checkpoint's s3:// folder is not contacted on its word alone
    last = str(tmp_path / "runs/stopped/tiny-baseline-seed0/checkpoints/last.ckpt")
    assert main(["eval", "--checkpoint", last, "--val-loss", "--no-log", "--accelerator", "cpu"]) == 2
    assert one_line(capsys) == [f"lrattn: error: checkpoint {last} trained on {url}; pass --data-dir {url} to read "
                                "it from object storage (a checkpoint's field alone does not)"]


def test_a_failed_upload_leaves_no_folder_fit_accepts_and_is_retried(s3_env, tmp_path, monkeypatch, capsys):
    """The connection drops after two files: meta.json (sent last) is not there, so `fit` refuses the prefix in one
    line; the same command then uploads the kept folder without preparing it again."""
    real = remote.client

    def flaky():
        s3 = real()
        calls = {"n": 0}
        upload = s3.upload_file

        def upload_file(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] > 2:
                from botocore.exceptions import EndpointConnectionError

                raise EndpointConnectionError(endpoint_url=s3_env["AWS_ENDPOINT_URL"])
            return upload(*args, **kwargs)

        s3.upload_file = upload_file
        return s3

    url = "s3://lrattn-data/corpora/flaky"
    with monkeypatch.context() as m:
        m.setattr(remote, "client", flaky)
        assert main([*ARGS, "--out", url]) == 2
    lines = one_line(capsys)
    assert len(lines) == 1 and "cannot reach" in lines[0] and "the same command uploads it again" in lines[0], lines
    assert "meta.json" not in objects("corpora/flaky") and len(objects("corpora/flaky")) == 2
    assert main(["fit", "--size", "tiny", "--ablation", "baseline", "--registry", REGISTRY, "--data.data_dir", url]) == 2
    assert "meta.json does not exist" in one_line(capsys)[0]
    assert main([*ARGS, "--out", url]) == 0
    assert "continuing the interrupted prepare" in capsys.readouterr().err
    assert "meta.json" in objects("corpora/flaky") and read_meta(url)["splits"]["train"]["documents"] > 0


def test_remote_shards_changed_since_prepare_are_named(s3_env, tmp_path, capsys):
    url = "s3://lrattn-data/corpora/damaged"
    prepare("stdlib-docs", url, max_documents=30, val_fraction=0.1, cloze_items=0, perplexity_documents=0)
    s3 = remote.client()
    s3.put_object(Bucket="lrattn-data", Key="corpora/damaged/train/chunk-0-0.bin", Body=b"short")
    assert main(["fit", "--size", "tiny", "--ablation", "baseline", "--registry", REGISTRY, "--data.data_dir", url]) == 2
    lines = one_line(capsys)
    assert len(lines) == 1 and "chunk-0-0.bin is corrupt: expected" in lines[0] and "found 5 bytes" in lines[0], lines
    assert not Path(tmp_path / "runs").exists()


@pytest.mark.usefixtures("mlflow_store")
def test_eval_reads_an_s3_folder_as_it_reads_a_local_one(s3_env, tmp_path, capsys):
    """`lrattn eval --data-dir s3://...` scores the local tasks (cloze, perplexity) and the exact validation loss
    from the uploaded folder: the same figures as from the same folder on disk."""
    url, local = "s3://lrattn-data/corpora/eval", tmp_path / "local"
    for out in (url, local):
        prepare("stdlib-docs", out, max_documents=60, val_fraction=0.1, cloze_items=12, perplexity_documents=6)
    assert main(["fit", "--size", "tiny", "--ablation", "baseline", "--registry", REGISTRY, "--data.data_dir", str(local),
                 "--data.batch_size", "2", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1",
                 "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
                 "--tracking_uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]) == 0
    ckpt = str(tmp_path / "runs/lrattn/tiny-baseline-seed0/checkpoints/last.ckpt")
    figures = {}
    for where in (url, str(local)):
        capsys.readouterr()
        assert main(["eval", "--checkpoint", ckpt, "--data-dir", where, "--tasks", "lrattn_cloze,lrattn_ppl",
                     "--val-loss", "--no-log", "--bootstrap-iters", "0", "--accelerator", "cpu"]) == 0
        out = capsys.readouterr().out
        figures[where] = [line for line in out.splitlines() if "|" in line or line.startswith("validation:")]
    assert any(line.startswith("validation: loss") for line in figures[url]), figures[url]
    assert any("lrattn_cloze" in line for line in figures[url]) and any("lrattn_ppl" in line for line in figures[url])
    assert figures[url] == figures[str(local)]


def test_a_remote_shard_rewritten_at_its_size_is_named_by_s3s_checksum(s3_env, tmp_path, capsys):
    """prepare uploads each file with its SHA-256 (S3 verifies it on arrival and keeps it); fit compares it with
    meta.json's by a HEAD request per shard: a same-size rewrite is one line. An object S3 keeps no SHA-256 for
    (another tool's upload) is checked by size only, with a warning that says so."""
    from lrattn_lightning.data.shards import validate_data_dir
    from lrattn_lightning.model.registry import load_registry

    url = "s3://lrattn-data/corpora/rewritten"
    prepare("stdlib-docs", url, max_documents=30, val_fraction=0.1, cloze_items=0, perplexity_documents=0)
    s3 = remote.client()
    key = "corpora/rewritten/train/chunk-0-0.bin"
    body = s3.get_object(Bucket="lrattn-data", Key=key)["Body"].read()
    assert s3.head_object(Bucket="lrattn-data", Key=key, ChecksumMode="ENABLED").get("ChecksumSHA256")
    tiny = load_registry(REGISTRY).size("tiny")
    validate_data_dir(url, tiny)
    assert "warning" not in capsys.readouterr().err
    changed = body[:-1] + bytes([(body[-1] + 1) % 256])
    s3.put_object(Bucket="lrattn-data", Key=key, Body=changed, ChecksumAlgorithm="SHA256")
    assert main(["fit", "--size", "tiny", "--ablation", "baseline", "--registry", REGISTRY, "--data.data_dir", url]) == 2
    lines = one_line(capsys)
    assert len(lines) == 1 and f"{url}/train/chunk-0-0.bin: contents changed since prepare (S3's sha256" in lines[0], lines
    assert not (tmp_path / "runs").exists()
    s3.put_object(Bucket="lrattn-data", Key=key, Body=body, ChecksumAlgorithm="CRC32")  # the right bytes, no SHA-256
    validate_data_dir(url, tiny)
    err = capsys.readouterr().err
    assert "S3 keeps no SHA-256 for 1 of the" in err and "train shards" in err and "checked by size only" in err, err
