"""The TLS helper (services/common/tls.py) and the flags that feed it.

Bad files are start-up errors naming the file (the commands print them and exit 2); contexts
verify peers with hostname checks; mTLS needs a CA; `exposure_warning` names the risk of a
plain listener beyond loopback, and the KV one also without a secret.
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from services.commands import router as router_command
from services.commands import serve as serve_command
from services.commands import up
from services.common import tls
from services.common.tls import TLSFileError, TLSFiles, exposure_warning, is_loopback
from services.kv_transfer.config import KVTransferConfig
from services.router.config import RouterConfig
from services.router.config import add_arguments as add_router_arguments
from services.worker.config import WorkerConfig
from services.worker.config import add_arguments as add_worker_arguments
from tests.support.certs import TestCA


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("pki"))


def test_files_are_checked_at_construction_and_named(ca: TestCA, tmp_path: Path) -> None:
    leaf = ca.issue("a")
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(TLSFileError, match=f"--tls-cert {missing} does not exist"):
        TLSFiles(cert=missing, key=str(leaf.key))
    with pytest.raises(TLSFileError, match="give both or neither"):
        TLSFiles(cert=str(leaf.cert))
    with pytest.raises(TLSFileError, match=f"--tls-ca {missing}"):
        TLSFiles(ca=missing)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(TLSFileError, match=f"cannot load the CA bundle {garbage}"):
        TLSFiles(ca=str(garbage))
    other = ca.issue("b")  # a key that does not belong to the certificate
    with pytest.raises(TLSFileError, match=f"cannot load the certificate {leaf.cert}"):
        TLSFiles(cert=str(leaf.cert), key=str(other.key))
    if os.geteuid() != 0:  # root reads any file
        unreadable = tmp_path / "secret.pem"
        unreadable.write_bytes(leaf.key.read_bytes())
        unreadable.chmod(0)
        with pytest.raises(TLSFileError, match="is not readable"):
            TLSFiles(cert=str(leaf.cert), key=str(unreadable))


def test_contexts_verify_peers_and_hostnames(ca: TestCA) -> None:
    files = ca.files("w")
    assert files.enabled and not TLSFiles().enabled
    assert TLSFiles().server_context() is None
    client = files.client_context()
    assert client.verify_mode is ssl.CERT_REQUIRED and client.check_hostname
    assert TLSFiles().client_context().verify_mode is ssl.CERT_REQUIRED  # the system store
    server = files.server_context()
    assert server is not None and server.verify_mode is ssl.CERT_NONE
    mtls = files.server_context(require_client_cert=True)
    assert mtls is not None and mtls.verify_mode is ssl.CERT_REQUIRED
    leaf = ca.issue("x")
    with pytest.raises(TLSFileError, match="needs --tls-ca"):
        tls.server_context(str(leaf.cert), str(leaf.key), None, require_client_cert=True)


async def test_a_certificate_must_name_the_address_it_is_reached_by(ca: TestCA) -> None:
    """Hostname checks are on: a certificate for localhost only does not serve 127.0.0.1."""
    localhost_only = ca.issue("named", hosts=("localhost",))
    ctx = tls.server_context(str(localhost_only.cert), str(localhost_only.key))
    app = web.Application()
    app.router.add_get("/", _hi)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx).start()
    port = runner.addresses[0][1]
    client = tls.client_context(str(ca.ca))
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client)) as s:
            async with s.get(f"https://localhost:{port}/") as resp:
                assert await resp.text() == "hi"
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                async with s.get(f"https://127.0.0.1:{port}/"):
                    pass
    finally:
        await runner.cleanup()


async def _hi(_: web.Request) -> web.Response:
    return web.Response(text="hi")


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.0.0.7", False),
    ("prefill.internal", False)])
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_exposure_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pdmesh.tls")
    assert exposure_warning("the router", "127.0.0.1", 8000, tls=False) is None
    assert exposure_warning("the router", "0.0.0.0", 8000, tls=True) is None
    plain = exposure_warning("the router", "0.0.0.0", 8000, tls=False)
    assert plain is not None and "plain HTTP" in plain and "0.0.0.0:8000" in plain
    # A KV listener: with a secret, only the plain-HTTP risk; without, it serves loopback only.
    with_secret = exposure_warning("the KV-transfer service", "10.0.0.7", 14579, tls=False,
                                   kv_secret=True)
    assert with_secret is not None and "plain HTTP" in with_secret
    open_kv = exposure_warning("the KV-transfer service", "10.0.0.7", 14579, tls=False,
                               kv_secret=False)
    assert open_kv is not None and "refuses every peer that is not on loopback" in open_kv
    assert "PDMESH_KV_SECRET" in open_kv
    tls_no_secret = exposure_warning("the KV-transfer service", "10.0.0.7", 1, tls=True,
                                     kv_secret=False)
    assert tls_no_secret is not None and "not on loopback" in tls_no_secret
    assert exposure_warning("the KV-transfer service", "10.0.0.7", 1, tls=True,
                            kv_secret=True) is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [plain, with_secret, open_kv, tls_no_secret]


async def test_kv_listener_warns_when_exposed(caplog: pytest.LogCaptureFixture) -> None:
    """The KV service runs the same check as it binds (here on all interfaces, no secret)."""
    from tests.support.kv import start_node

    caplog.set_level(logging.WARNING, logger="pdmesh.tls")
    node = await start_node("prefill", host="0.0.0.0")
    try:
        assert any("refuses every peer that is not on loopback" in r.getMessage()
                   for r in caplog.records)
    finally:
        await node.runner.cleanup()


def _parse(add: object, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)  # type: ignore[operator]
    return parser.parse_args(argv)


def test_flags_build_the_configs(ca: TestCA) -> None:
    leaf = ca.issue("flags")
    files = ["--tls-cert", str(leaf.cert), "--tls-key", str(leaf.key), "--tls-ca", str(ca.ca)]
    router = RouterConfig.from_args(_parse(add_router_arguments, [
        *files, "--prefill", "https://127.0.0.1:8100", "--decode", "https://127.0.0.1:8200",
        "--cors-allow-origin", "https://app.example", "--cors-allow-origin", "*"]), {})
    assert router.tls == TLSFiles(str(leaf.cert), str(leaf.key), str(ca.ca))
    assert router.cors_allow_origins == ("https://app.example", "*")
    worker = WorkerConfig.from_args(_parse(add_worker_arguments, [
        *files, "--role", "prefill", "--kv-require-client-cert"]), {})
    assert worker.tls == router.tls
    assert worker.kv is not None and worker.kv.tls == worker.tls  # the KV reuses the files
    assert worker.kv.require_client_cert
    with pytest.raises(ValueError, match="--kv-require-client-cert needs"):
        KVTransferConfig(require_client_cert=True, tls=TLSFiles(ca=str(ca.ca)))
    with pytest.raises(ValueError, match="cors-allow-origin"):
        RouterConfig(cors_allow_origins=("app.example",))


@pytest.mark.parametrize("command", [router_command, serve_command])
def test_a_bad_file_is_a_startup_error_not_a_traceback(
        command: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "cert.pem")
    args = _parse(command.add_arguments,  # type: ignore[attr-defined]
                  ["--tls-cert", missing, "--tls-key", missing])
    assert command.run(args) == 2  # type: ignore[attr-defined]
    err = capsys.readouterr().err
    assert f"--tls-cert {missing} does not exist" in err and "Traceback" not in err


def test_up_passes_tls_to_every_child(ca: TestCA) -> None:
    leaf = ca.issue("up")
    args = _parse(up.add_arguments, ["--tls-cert", str(leaf.cert), "--tls-key", str(leaf.key),
                                     "--tls-ca", str(ca.ca), "--kv-require-client-cert",
                                     "--serve-cmd", "serve", "--port", "18000"])
    specs, url = up.plan(args, cpu_count=2)
    assert url == "https://127.0.0.1:18000"
    router, *workers = specs
    for spec in specs:
        argv = list(spec.argv)
        assert argv[argv.index("--tls-cert") + 1] == str(leaf.cert)
        assert argv[argv.index("--tls-ca") + 1] == str(ca.ca)
    assert all("--kv-require-client-cert" in w.argv for w in workers)
    worker_urls = [a for a in router.argv if "://" in a]
    assert worker_urls and all(u.startswith("https://") for u in worker_urls)

