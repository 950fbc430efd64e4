"""Prepared folders in object storage: `prepare --out s3://BUCKET/PREFIX` and `--data.data_dir s3://...`.

The endpoint and credentials come from the environment, as for any AWS tool (boto3 reads AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_PROFILE, AWS_ENDPOINT_URL for an S3-compatible server, ...). An upload sends every
file, then meta.json last: `fit` reads meta.json first, so it never accepts a half-uploaded folder (an
--overwrite deletes the old meta.json before anything else). Training streams the chunks through litdata,
which keeps them in a local cache; meta.json, index.json and the tokenizer are fetched into the same cache:

    LRATTN_CACHE_DIR (default ~/.cache/lrattn)/
      s3/BUCKET/PREFIX/                 meta.json, train/index.json, ... fetched again at each start
      s3/BUCKET/PREFIX/chunks/SPLIT/    litdata's chunk cache (inside, a folder per index.json it was made from)
      upload/BUCKET-PREFIX-HASH/NAME    where `prepare --out s3://...` builds the folder before uploading

A wrong bucket, missing credentials, refused credentials or an unreachable endpoint is one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Any

from lrattn_lightning.core.errors import InputError
from lrattn_lightning.core.files import refuse_link
from lrattn_lightning.data.staging import check_stop

SCHEME = "s3://"


class UploadFailed(InputError):
    """An upload of a finished folder failed: it is kept, so the same command only uploads it again."""


def is_remote(path: str | Path | None) -> bool:
    return isinstance(path, str) and path.startswith(SCHEME)


def split_url(url: str) -> tuple[str, str]:
    """s3://bucket/a/b -> ('bucket', 'a/b'); InputError for a URL without a bucket."""
    bucket, _, prefix = url[len(SCHEME):].partition("/")
    if not bucket:
        raise InputError(f"{url}: no bucket; write s3://BUCKET/PREFIX")
    return bucket, prefix.strip("/")


def cache_root() -> Path:
    base = os.environ.get("LRATTN_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lrattn"
    return Path(base)


def _slug(url: str) -> str:
    bucket, prefix = split_url(url)
    return f"{bucket}/{prefix}" if prefix else bucket


def local_dir(url: str) -> Path:
    """The cache folder of a remote prepared folder (its small files and its chunk caches)."""
    return cache_root() / "s3" / _slug(url)


def staging_out(url: str) -> Path:
    """Where `prepare --out URL` builds the folder before the upload (a resume finds it again)."""
    bucket, prefix = split_url(url)
    tag = hashlib.sha256(url.encode()).hexdigest()[:10]
    return cache_root() / "upload" / f"{bucket}-{prefix.replace('/', '-')}-{tag}"[:120] / "data"


def client() -> Any:
    """An S3 client from the environment as it is now (a new session: boto3's default one keeps the first
    credentials it found)."""
    import boto3

    return boto3.session.Session().client("s3")


def explain(err: BaseException, url: str) -> InputError:
    """One line for what went wrong talking to object storage, with the fix."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    bucket, _ = split_url(url)
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3") or "AWS S3"
    if isinstance(err, NoCredentialsError):
        return InputError(f"{url}: no S3 credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")
    if isinstance(err, EndpointConnectionError):
        return InputError(f"{url}: cannot reach {endpoint} ({err}); check AWS_ENDPOINT_URL and the network")
    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchBucket", "404", "NotFound") and "Key" not in str(err.response.get("Error", {})):
            return InputError(f"{url}: bucket '{bucket}' does not exist at {endpoint}; check the name, or create it")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "AccessDenied",
                    "403", "Forbidden", "InvalidClientTokenId"):
            return InputError(f"{url}: {endpoint} refused the credentials ({code}); check AWS_ACCESS_KEY_ID, "
                              "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the bucket's permissions")
        return InputError(f"{url}: {endpoint} answered {code or 'an error'} ({err})")
    return InputError(f"{url}: {type(err).__name__}: {err}")


def _boto_errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError)


def check_target(url: str, overwrite: bool) -> None:
    """Before anything is written: the bucket exists, the credentials work, and URL holds no prepared folder
    (unless `overwrite`)."""
    bucket, prefix = split_url(url)
    if not prefix:
        raise InputError(f"--out {url}: give a prefix (s3://{bucket}/NAME), the folder's name in the bucket")
    s3 = client()
    try:
        s3.head_bucket(Bucket=bucket)
        found = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/meta.json", MaxKeys=1).get("KeyCount", 0)
    except _boto_errors() as err:
        raise explain(err, url) from err
    if found and not overwrite:
        raise InputError(f"--out {url} already holds a prepared folder; pass --overwrite to replace it, or choose "
                         "another --out")


def upload(local: Path, url: str, overwrite: bool) -> None:
    """Every file of `local` under URL, meta.json last; objects of an older folder there that the new one does not
    have are deleted (after its meta.json, first)."""
    bucket, prefix = split_url(url)
    s3 = client()
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != "meta.json" and ".prepare" not in p.parts)
    try:
        old = _keys(s3, bucket, prefix)
        if f"{prefix}/meta.json" in old:
            s3.delete_object(Bucket=bucket, Key=f"{prefix}/meta.json")
        checked = _with_sha256()
        for path in files:
            check_stop()  # a signal stops the upload between files; the same command uploads again
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local).as_posix()}", **checked)
        new = {f"{prefix}/{p.relative_to(local).as_posix()}" for p in files}
        for key in sorted(set(old) - new - {f"{prefix}/meta.json"}):
            s3.delete_object(Bucket=bucket, Key=key)
        s3.upload_file(str(local / "meta.json"), bucket, f"{prefix}/meta.json", **checked)
    except _boto_errors() as err:
        raise explain(err, url) from err


def _with_sha256() -> dict[str, Any]:
    """upload_file's arguments that make S3 keep each object's SHA-256 (verified by the server on upload): one
    PUT per file (shards are far below S3's 5 GiB limit of one PUT), so it is the whole file's, as meta.json's."""
    from boto3.s3.transfer import TransferConfig

    return {"ExtraArgs": {"ChecksumAlgorithm": "SHA256"}, "Config": TransferConfig(multipart_threshold=5 << 30)}


def sha256s(url: str, names: list[str]) -> dict[str, str | None]:
    """{name: hex SHA-256 that S3 keeps for the object URL/name, or None if it keeps none (an object written by
    another tool)}: one HEAD request each, in threads; no object is downloaded."""
    import base64
    from concurrent.futures import ThreadPoolExecutor

    bucket, prefix = split_url(url)
    s3 = client()

    def one(name: str) -> str | None:
        head = s3.head_object(Bucket=bucket, Key=f"{prefix}/{name}", ChecksumMode="ENABLED")
        value = head.get("ChecksumSHA256")
        if not value or "-" in value:  # none, or a multipart upload's checksum of checksums
            return None
        return base64.b64decode(value).hex()

    try:
        with ThreadPoolExecutor(max_workers=min(16, max(len(names), 1))) as pool:
            return dict(zip(names, pool.map(one, names), strict=True))
    except _boto_errors() as err:
        raise explain(err, url) from err


def _keys(s3: Any, bucket: str, prefix: str) -> dict[str, int]:
    keys: dict[str, int] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        keys.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return keys


def sizes(url: str) -> dict[str, int]:
    """{path under URL: size} of every object there."""
    bucket, prefix = split_url(url)
    try:
        keys = _keys(client(), bucket, prefix)
    except _boto_errors() as err:
        raise explain(err, url) from err
    return {k[len(prefix) + 1:]: v for k, v in keys.items()}


def fetch(url: str, name: str) -> Path:
    """The file NAME of the remote folder URL, downloaded into its cache folder (again each time: it is small)."""
    bucket, prefix = split_url(url)
    dst = local_dir(url) / name
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    refuse_link(dst, "cached file")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # boto3 writes its own temporary and renames it over `tmp`: nothing at `tmp` is followed
    try:
        client().download_file(bucket, f"{prefix}/{name}", str(tmp))
    except _boto_errors() as err:
        tmp.unlink(missing_ok=True)
        from botocore.exceptions import ClientError

        if isinstance(err, ClientError) and str(err.response.get("Error", {}).get("Code")) in ("404", "NoSuchKey"):
            try:
                client().head_bucket(Bucket=bucket)
            except _boto_errors() as bucket_err:
                raise explain(bucket_err, url) from bucket_err
            raise FileNotFoundError(f"{url}/{name} does not exist") from err
        raise explain(err, url) from err
    os.replace(tmp, dst)
    return dst


def local_file(data_dir: str | Path, name: str, missing_ok: bool = False) -> Path:
    """The file NAME of a prepared folder on this machine: fetched into the cache from an s3:// prefix. With
    `missing_ok`, an object that is not there gives DATA_DIR/NAME (not a file: the caller's check names it)."""
    if not is_remote(data_dir):
        return Path(data_dir) / name
    try:
        return fetch(str(data_dir), name)
    except FileNotFoundError:
        if not missing_ok:
            raise
        return Path(f"{data_dir}/{name}")


def allow_plain_http() -> None:
    """litdata fetches chunks with obstore, built with fixed client options that refuse http:// endpoints; an
    S3-compatible server on plain http (AWS_ENDPOINT_URL=http://..., MinIO, moto) then fails with 'BadScheme'.
    Allow http only when the user's endpoint is http."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    if endpoint.startswith("http://"):
        from litdata.streaming import downloader

        options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
        if isinstance(options, dict):
            options["allow_http"] = "true"
