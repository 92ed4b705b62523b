from workbench.cluster.status import ClusterStatus, TaskRecord


def _status():
    tasks = [
        TaskRecord("ps", 0, 0, "h", "127.0.0.1:5000", 11, ["/job:ps/replica:0/task:0/device:CPU:0"], [], "running"),
        TaskRecord("worker", 0, 1, "h", "127.0.0.1:5001", 12,
                   ["/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:0/device:GPU:0"],
                   ["0"], "running"),
        TaskRecord("worker", 1, 2, "h", "127.0.0.1:5002", 13, [], [], "lost"),
    ]
    return ClusterStatus("demo", "running", "local", tasks)


def test_text_table_has_a_row_per_task_in_aligned_columns():
    text = str(_status())
    lines = text.splitlines()
    assert lines[0] == "cluster 'demo': running, 1 ps + 2 worker task(s), engines: local"
    assert lines[1].split() == ["task", "engine", "host", "address", "pid", "devices", "GPUs", "state"]
    assert lines[3].split() == ["ps:0", "0", "h", "127.0.0.1:5000", "11", "CPU:0", "none", "running"]
    assert "CPU:0, GPU:0" in lines[4] and lines[4].split()[-1] == "running"
    assert lines[5].split()[-1] == "lost"
    assert len({line.index("address") if "address" in line else None for line in lines[1:2]}) == 1


def test_html_escapes_and_marks_states():
    html = _status()._repr_html_()
    assert html.count("<tr>") == 4
    assert "worker:1" in html and "lost" in html and "#c62828" in html
    status = _status()
    status.name = "<script>"
    assert "<script>" not in status._repr_html_()
