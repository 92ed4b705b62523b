"""The server extension's REST routes, in a real Jupyter server (pytest-jupyter)."""

import dataclasses
import json
import os

import pytest
import tornado.httpclient

from workbench.cluster import registry
from workbench.cluster.registry import ClusterRecord, Endpoint
from workbench.cluster.status import TaskRecord
from workbench.server.models import ClusterInfo, ErrorBody, TaskInfo

ROUTES = [("GET", "workbench/api/clusters"), ("POST", "workbench/api/clusters"), ("GET", "workbench/api/options"),
          ("GET", "workbench/api/clusters/some-name"), ("PATCH", "workbench/api/clusters/some-name"),
          ("DELETE", "workbench/api/clusters/some-name"), ("GET", "workbench/api/clusters/some-name/plots"),
          ("GET", "workbench/api/clusters/some-name/summary"), ("GET", "workbench/dashboards/some-name/timeline"),
          ("GET", "workbench/dashboards/some-name/static/js/bokeh.min.js")]


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"workbench.server": True}}}


def _record(name: str, **extra) -> ClusterRecord:
    """A registry record as ``Cluster`` writes it, owned by this (live) process."""
    import psutil

    me = psutil.Process()
    values = dict(name=name, state="running", engines="local", owned=True, client_pid=me.pid,
                  client_created=me.create_time(), spec={"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},
                  tasks=[TaskRecord("ps", 0, 0, "h", "127.0.0.1:1", me.pid, ["/job:ps/replica:0/task:0/device:CPU:0"], [],
                                    "running", "2.21.0")],
                  endpoints={"dashboard": Endpoint("http://127.0.0.1:5006")}, updated=1.0, workbench_version="0.1.0")
    return ClusterRecord(**{**values, **extra})


@pytest.fixture
def registered():
    registry.write_record(_record("wb-route-test"))
    yield "wb-route-test"
    registry.remove_record("wb-route-test")


async def test_clusters_lists_the_registry_in_the_contract_shape(jp_fetch, registered):
    response = await jp_fetch("workbench", "api", "clusters")
    body = json.loads(response.body)
    mine = next(c for c in body["clusters"] if c["name"] == registered)
    assert set(mine) == {f.name for f in dataclasses.fields(ClusterInfo)}
    assert set(mine["tasks"][0]) == {f.name for f in dataclasses.fields(TaskInfo)}
    assert mine["tasks"][0]["name"] == "ps:0" and mine["dashboard"] == "http://127.0.0.1:5006"
    one = json.loads((await jp_fetch("workbench", "api", "clusters", registered)).body)
    assert one == mine


async def test_unknown_and_bad_names_get_404_and_400_with_what_to_do(jp_fetch, registered):
    for name, status, text in [("nosuch", 404, "no running cluster named 'nosuch'"),
                               ("bad name!", 400, "is not a cluster name")]:
        with pytest.raises(tornado.httpclient.HTTPClientError) as info:
            await jp_fetch("workbench", "api", "clusters", name)
        assert info.value.code == status
        body = json.loads(info.value.response.body)
        assert set(body) == {f.name for f in dataclasses.fields(ErrorBody)} and text in body["error"]


async def test_a_cluster_whose_owner_died_is_not_listed(jp_fetch):
    registry.write_record(_record("wb-route-dead", client_pid=2**22 + 7, client_created=1.0))
    body = json.loads((await jp_fetch("workbench", "api", "clusters")).body)
    assert "wb-route-dead" not in [c["name"] for c in body["clusters"]]
    assert not os.path.exists(registry.registry_path("wb-route-dead"))  # the stale record was pruned


@pytest.mark.parametrize("method, route", ROUTES)
async def test_every_route_refuses_unauthenticated_requests(jp_fetch, method, route):
    body = "{}" if method in ("POST", "PATCH") else None
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await jp_fetch(*route.split("/"), method=method, body=body, headers={"Authorization": ""},  # no token
                       follow_redirects=False)
    if route.startswith("workbench/dashboards/"):  # pages send the browser to the login page instead
        assert info.value.code == 302 and "/login?next=" in info.value.response.headers["Location"]
    else:
        assert info.value.code == 403


async def test_the_dashboard_websocket_refuses_unauthenticated_sessions(jp_ws_fetch):
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await jp_ws_fetch("workbench", "dashboards", "some-name", "timeline", "ws", headers={"Authorization": ""})
    assert info.value.code == 403


async def test_a_task_whose_engine_died_on_this_host_shows_as_lost(jp_fetch):
    import socket

    record = _record("wb-route-lost")
    record.tasks[0].host, record.tasks[0].pid = socket.gethostname(), 2**22 + 11  # no such process
    registry.write_record(record)
    try:
        body = json.loads((await jp_fetch("workbench", "api", "clusters", "wb-route-lost")).body)
        assert body["tasks"][0]["state"] == "lost"
    finally:
        registry.remove_record("wb-route-lost")


async def test_a_body_that_is_not_json_gets_a_400_error_body(jp_fetch):
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await jp_fetch("workbench", "api", "clusters", method="POST", body="{not json")
    body = json.loads(info.value.response.body)
    assert info.value.code == 400 and body == {"error": "the request body is not JSON: send a JSON object.", "status": 400}
