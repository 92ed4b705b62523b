"""The server extension's routes against the known web attacks, and against any body at all.

- DNS rebinding: a page on another site whose name now resolves to 127.0.0.1 sends its own name in
  ``Host``; Jupyter refuses it (``check_host``) on every route, the workbench's included.
- Cross-site requests with the user's login cookie: a websocket from a foreign ``Origin`` and a POST
  without the XSRF token are refused; the same cookie from the page's own origin is accepted.
- Fuzzing (hypothesis) against a real Jupyter server: whatever the body or the cluster name, the
  answer is a 4xx ``ErrorBody``, never a 500 or a traceback, and nothing starts.
"""

import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import tornado.httpclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jupyter_helpers import stop_server, wait_for_server

from workbench.errors import ConfigurationError
from workbench.server.models import StartForm


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"workbench.server": True}}}


async def _login_cookie(jp_fetch, jp_auth_header) -> str:
    """The cookie a browser holds after the user opened the server's link with its token."""
    token = jp_auth_header["Authorization"].split()[1]
    response = await jp_fetch("api", "status", params={"token": token}, headers={"Authorization": ""})
    cookies = [c.split(";", 1)[0] for c in response.headers.get_list("Set-Cookie")]
    assert cookies, "no login cookie was set"
    return "; ".join(cookies)


@pytest.mark.parametrize("route", [("workbench", "api", "clusters"), ("workbench", "api", "options"),
                                   ("workbench", "dashboards", "some-name", "timeline")])
async def test_a_rebound_host_name_is_refused(jp_fetch, route):
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await jp_fetch(*route, headers={"Host": "attacker.example:8888"}, follow_redirects=False)
    assert info.value.code == 403


async def test_a_cross_site_websocket_is_refused_even_with_the_users_cookie(jp_fetch, jp_ws_fetch, jp_auth_header,
                                                                            jp_http_port):
    cookie = await _login_cookie(jp_fetch, jp_auth_header)
    route = ("workbench", "dashboards", "no-such-cluster", "timeline", "ws")
    as_issued = {"Authorization": "", "Cookie": cookie, "Host": f"127.0.0.1:{jp_http_port}"}  # the cookie's host
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await jp_ws_fetch(*route, headers={**as_issued, "Origin": "http://attacker.example"})
    assert info.value.code == 403
    # the same cookie from the server's own origin gets through the checks: refused only for the unknown cluster
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await jp_ws_fetch(*route, headers={**as_issued, "Origin": f"http://127.0.0.1:{jp_http_port}"})
    assert info.value.code == 404


async def test_a_cross_site_post_with_the_users_cookie_starts_nothing(jp_fetch, jp_auth_header, jp_http_port):
    cookie = await _login_cookie(jp_fetch, jp_auth_header)
    form = json.dumps({"ps": 0, "workers": 1, "name": "wb-cross-site"})
    # from another site: Jupyter hides its API from cross-origin requests (404)
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await jp_fetch("workbench", "api", "clusters", method="POST", body=form,
                       headers={"Authorization": "", "Cookie": cookie, "Origin": "http://attacker.example"})
    assert info.value.code == 404
    # from the server's own origin, without the XSRF token that only its pages can read: refused (403)
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await jp_fetch("workbench", "api", "clusters", method="POST", body=form,
                       headers={"Authorization": "", "Cookie": cookie, "Origin": f"http://127.0.0.1:{jp_http_port}"})
    assert info.value.code == 403
    listed = json.loads((await jp_fetch("workbench", "api", "clusters")).body)["clusters"]
    assert "wb-cross-site" not in [c["name"] for c in listed]


# -- fuzzing, against a real server ----------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A Jupyter server with the workbench extension: (base URL, the registry directory it reads)."""
    runtime = tmp_path_factory.mktemp("fuzz-runtime")
    command = [sys.executable, "-m", "jupyter", "server", "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0",
               "--IdentityProvider.token=fuzz", f"--ServerApp.root_dir={runtime}", "--allow-root"]
    process = subprocess.Popen(command, env={**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield wait_for_server(runtime, process)
    finally:
        stop_server(process)


def _call(base: str, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{base}/{path}", method=method, data=body,
                                     headers={"Authorization": "token fuzz", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                           max_leaves=12)
form_like = st.dictionaries(st.sampled_from(["ps", "workers", "gpus_per_worker", "engines", "profile", "name", "n"]),
                            json_values, min_size=1, max_size=4)


def _starts_a_cluster(body) -> bool:
    try:
        StartForm.parse(body)
    except ConfigurationError:
        return False
    return True


def _is_error_body(status: int, raw: bytes) -> bool:
    body = json.loads(raw)
    return set(body) == {"error", "status"} and body["status"] == status and "Traceback" not in body["error"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(json_values, form_like, st.binary(max_size=64)))
def test_any_start_request_body_gets_a_4xx_error_body(server, body):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    if parsed is not None and _starts_a_cluster(parsed):
        return  # a valid form would start a real cluster: not this test's business
    status, answer = _call(server, "POST", "workbench/api/clusters", raw)
    assert status == 400 and _is_error_body(status, answer), (body, status, answer)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(min_size=1, max_size=30), body=st.one_of(json_values, st.binary(max_size=32)),
       method=st.sampled_from(["GET", "PATCH", "DELETE"]))
def test_any_cluster_name_and_body_get_a_4xx_error_body(server, name, body, method):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    path = "workbench/api/clusters/" + urllib.parse.quote(name, safe="")
    status, answer = _call(server, method, path, raw if method == "PATCH" else None)
    assert status in (400, 404, 405) and (status == 405 or _is_error_body(status, answer)), (name, status, answer)


def test_the_registry_the_fuzzing_server_read_is_intact():
    """The fuzzing started nothing and removed nothing: the registry holds no record it made."""
    directory = Path(os.environ["WORKBENCH_REGISTRY_DIR"])
    assert not [p for p in directory.glob("*.json") if "fuzz" in p.name]
