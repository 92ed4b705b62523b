"""Acting on real clusters through the server extension: start, scale, stop, plots, summary, proxy."""

import asyncio
import dataclasses
import html
import json
import urllib.request

import pytest
import tornado.httpclient
from training_helpers import train

import workbench as wb
from workbench.cluster import registry
from workbench.server.handlers import LIST_WAIT
from workbench.server.models import ClusterInfo, ErrorBody, PlotLink

pytestmark = pytest.mark.cluster


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"workbench.server": True}}}


async def _json(jp_fetch, *path, **kwargs):
    return json.loads((await jp_fetch(*path, **kwargs)).body)


async def _error(jp_fetch, *path, **kwargs) -> tuple[int, dict]:
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await jp_fetch(*path, **kwargs)
    body = json.loads(info.value.response.body)
    assert set(body) == {f.name for f in dataclasses.fields(ErrorBody)}
    return info.value.code, body


async def test_plots_are_served_through_the_jupyter_server(jp_fetch, jp_base_url, cluster):
    body = await _json(jp_fetch, "workbench", "api", "clusters", cluster.name, "plots")
    names = [p["name"] for p in body["plots"]]
    assert {"timeline", "throughput", "progress", "dashboard", "profile"} <= set(names)
    assert all(set(p) == {f.name for f in dataclasses.fields(PlotLink)} for p in body["plots"])
    timeline = next(p for p in body["plots"] if p["name"] == "timeline")
    assert timeline["path"] == f"{jp_base_url}workbench/dashboards/{cluster.name}/timeline"
    # the page, and the BokehJS it loads, come through the proxy (same path, under the server's base_url)
    page = (await jp_fetch(*timeline["path"][len(jp_base_url):].split("/"))).body.decode()
    assert "Bokeh" in page and f"{jp_base_url}workbench/dashboards/{cluster.name}/static/" in page
    static = page.split(f"{jp_base_url}workbench/dashboards/{cluster.name}/static/", 1)[1].split('"', 1)[0]
    script = await jp_fetch("workbench", "dashboards", cluster.name, "static", *static.split("?")[0].split("/"))
    assert script.code == 200 and len(script.body) > 100_000
    # the owner serves them on 127.0.0.1 only; the browser never needs that port
    record = registry.read_record(cluster.name)
    assert record.endpoints["control"].url.startswith("http://127.0.0.1:")


async def test_summary_reports_the_newest_job(jp_fetch, cluster):
    train(cluster, strategy=wb.AsyncPS(steps_per_call=10), steps=40).wait(300)
    body = await _json(jp_fetch, "workbench", "api", "clusters", cluster.name, "summary")
    assert body["cluster"] == cluster.name
    assert body["job"]["steps_done"] == body["job"]["steps_total"] == 40 and body["job"]["state"] == "finished"


async def test_a_waiting_list_answers_as_soon_as_a_job_begins_and_ends(jp_fetch, cluster):
    listing = await _json(jp_fetch, "workbench", "api", "clusters")
    assert {c["name"]: c["job"] for c in listing["clusters"]}[cluster.name] == ""
    held = asyncio.ensure_future(_json(jp_fetch, "workbench", "api", "clusters", params={"after": listing["version"]}))
    await asyncio.sleep(1.0)
    assert not held.done(), "the list was answered though nothing changed"
    loop = asyncio.get_running_loop()
    job = await loop.run_in_executor(None, lambda: train(cluster, strategy=wb.AsyncPS(steps_per_call=10), steps=300))
    began = await asyncio.wait_for(held, LIST_WAIT)  # not held to the end: answered when the job began
    assert {c["name"]: c["job"] for c in began["clusters"]}[cluster.name] == job.name
    held = asyncio.ensure_future(_json(jp_fetch, "workbench", "api", "clusters", params={"after": began["version"]}))
    await loop.run_in_executor(None, lambda: job.wait(300))
    ended = await asyncio.wait_for(held, LIST_WAIT)
    assert {c["name"]: c["job"] for c in ended["clusters"]}[cluster.name] == ""
    summary = (await _json(jp_fetch, "workbench", "api", "clusters", cluster.name, "summary"))["job"]
    await asyncio.sleep(3.0)  # past the rate window: an ended job still shows what it did, and its time stays
    later = (await _json(jp_fetch, "workbench", "api", "clusters", cluster.name, "summary"))["job"]
    assert later["state"] == "finished" and later["examples_per_s"] > 0 and later["elapsed_s"] == summary["elapsed_s"]
    assert later["examples_per_s"] == pytest.approx(job.throughput()["examples_per_s"], rel=0.05)


async def test_a_plot_pane_of_a_cluster_that_is_not_running_says_so_in_a_page(jp_fetch):
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await jp_fetch("workbench", "dashboards", "wb-gone", "timeline")
    page = html.unescape(info.value.response.body.decode())
    assert info.value.code == 404 and info.value.response.headers["Content-Type"].startswith("text/html")
    assert "Cluster 'wb-gone' is not running" in page and "open its plots from the Workbench panel" in page


async def test_scale_and_stop_reach_the_owner(jp_fetch, no_leftover_processes):
    owner = wb.Cluster(ps=1, workers=1, name="wb-route-scaled", progress=False).start()
    try:
        info = await _json(jp_fetch, "workbench", "api", "clusters", owner.name, method="PATCH",
                           body=json.dumps({"workers": 2}))
        assert [t["name"] for t in info["tasks"]] == ["ps:0", "worker:0", "worker:1"]
        assert len(owner.tasks) == 3  # the owner's own object changed: it did the scaling
        code, body = await _error(jp_fetch, "workbench", "api", "clusters", owner.name, method="PATCH",
                                  body=json.dumps({"workers": "many"}))
        assert code == 400 and "integer >= 1" in body["error"]
        stopped = await _json(jp_fetch, "workbench", "api", "clusters", owner.name, method="DELETE")
        assert stopped == {"stopped": owner.name}
        assert owner.state == "stopped" and not registry.registry_path(owner.name).exists()
    finally:
        owner.stop()


async def test_a_cluster_started_from_the_panel_is_owned_by_the_server(jp_fetch, jp_serverapp, no_leftover_processes):
    options = await _json(jp_fetch, "workbench", "api", "options")
    assert "local" in options["engines"] and isinstance(options["profiles"], list)
    form = {"ps": 1, "workers": 1, "name": "wb-from-panel"}
    info = await _json(jp_fetch, "workbench", "api", "clusters", method="POST", body=json.dumps(form))
    try:
        assert set(info) == {f.name for f in dataclasses.fields(ClusterInfo)}
        assert info["name"] == "wb-from-panel" and info["owned_here"] and info["state"] == "running"
        assert [t["state"] for t in info["tasks"]] == ["running", "running"]
        code, body = await _error(jp_fetch, "workbench", "api", "clusters", method="POST", body=json.dumps(form))
        assert code == 400 and "already running" in body["error"]
    finally:
        await jp_fetch("workbench", "api", "clusters", "wb-from-panel", method="DELETE")
    assert "wb-from-panel" not in [c.name for c in wb.running_clusters()]


@pytest.mark.parametrize("form, text", [
    ({"workers": 0}, "workers=0: an integer from 1 to 64"),
    ({"ps": "one"}, "ps='one'"),
    ({"engines": "kubernetes"}, "engines='kubernetes': one of local"),
    ({"gpus": 1}, "unknown field(s) ['gpus']"),
    ({"name": "bad name!"}, "not a valid cluster name"),
    ({"queue": 3}, "queue=3: text"),
    ({"options": "nonsense"}, "launcher option 'nonsense': write KEY=VALUE"),
    ({"queue": "gpu"}, "unknown launcher option(s) 'queue' for engines launched by ForkEngineSetLauncher"),
    ({"options": "remote_python='/opt/py'"}, "unknown launcher option(s) 'remote_python'"),
])
async def test_a_bad_start_form_is_refused_with_what_to_change(jp_fetch, form, text):
    code, body = await _error(jp_fetch, "workbench", "api", "clusters", method="POST", body=json.dumps(form))
    assert code == 400 and text in body["error"], body


async def test_the_proxy_says_which_cluster_is_unknown(jp_fetch):
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await jp_fetch("workbench", "dashboards", "nosuch", "timeline")
    assert info.value.code == 404 and "no running cluster named 'nosuch'" in html.unescape(info.value.response.body.decode())


def test_the_control_endpoint_refuses_requests_without_the_token(cluster):
    record = registry.read_record(cluster.name)
    request = urllib.request.Request(f"{record.endpoints['control'].url}/scale", data=b'{"workers": 1}', method="POST",
                                     headers={"Authorization": "token wrong"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 403 and len(cluster.tasks) == 3
    # with the right token, but addressed to another host name (a DNS-rebinding page): refused as well
    rebound = urllib.request.Request(f"{record.endpoints['control'].url}/summary",
                                     headers={"Authorization": f"token {record.endpoints['control'].token}",
                                              "Host": "attacker.example"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(rebound, timeout=10)
    assert info.value.code == 403 and b"127.0.0.1 only" in info.value.read()
