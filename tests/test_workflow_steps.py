"""The steps server workflows are made of (fedmed.workflows.base): typed replies that carry their error, one
statistic gathered from every site, a per-cluster round, several models in one message, aggregation passed in."""

import numpy as np
import pytest

from fedmed.core.packing import pack_models, unpack_model, unpack_models
from fedmed.workflows.aggregators import DownWeighted, WeightedAverage
from fedmed.workflows.base import Reply, Workflow, round_mean, screen


def _reply(site, value, n, error=None, **metrics):
    meta = {"n_train": n, **({"error": error} if error else {})}
    return Reply(site, metrics, meta, {} if error else {"w": np.full(2, value, dtype=np.float32)})


def test_a_reply_is_a_tuple_with_its_error():
    r = _reply("site-1", 1.0, 4)
    site, metrics, meta, params = r  # what workflows unpack
    assert site == "site-1" and r.error is None and params is r.params
    assert _reply("site-2", 0, 4, error="site-2: no data").error == "site-2: no data"
    bad = screen([Reply("site-3", {}, {"n_train": 1}, {"w": np.array([np.nan])})])[0]
    assert isinstance(bad, Reply) and "NaN or infinite" in bad.error and bad.params == {}


def test_aggregation_is_passed_in_not_inherited():
    """FedAvg_w's down-weighting used to live in FedAvg, so IFCA, CFL and Flux inherited a down_weight_site; now a
    workflow is given its aggregator (FedAvg's weighted average by default)."""
    from fedmed.methods.cfl import CFL
    from fedmed.methods.flux import Flux
    from fedmed.methods.ifca import IFCA

    rows = [_reply("site-1", 1.0, 1), _reply("site-2", 4.0, 3)]
    assert np.allclose(WeightedAverage().aggregate(rows)["w"], 3.25)
    assert np.allclose(DownWeighted("site-2", 0.0).aggregate(rows)["w"], 1.0)
    assert np.allclose(DownWeighted("site-9", 0.0).aggregate(rows)["w"], 3.25)  # a site not in the round
    for wf in (CFL(2, {}, eps1=0.4, eps2=1.6, warmup_rounds=2), IFCA(2, {}, k=2, participation=1.0,
                                                                   empty_cluster="global")):
        assert isinstance(wf.aggregator, WeightedAverage) and not hasattr(wf, "down_weight_site")
    given = DownWeighted("site-1", 0.5)
    cfl = CFL(2, {}, eps1=0.4, eps2=1.6, warmup_rounds=2, aggregator=given)
    assert cfl.aggregator is given and np.allclose(cfl.aggregate(rows)["w"], (0.5 * 1 + 4 * 3) / 3.5)
    flux = Flux(2, {}, flux={"pca_seed": 0}, participation=1.0, n_clusters=0, scale=1.0, k1_silhouette=None,
                scaling="none", start_rule="paper")
    assert not hasattr(flux, "down_weight_site")


def test_several_models_travel_packed_and_come_back():
    models = {0: {"a": np.ones(2), "b": np.zeros(1)}, 3: {"a": np.full(2, 3.0), "b": np.ones(1)}}
    packed = pack_models(models)
    assert sorted(packed) == ["m0/a", "m0/b", "m3/a", "m3/b"]
    back = unpack_models(packed)
    assert sorted(back) == [0, 3] and np.array_equal(back[3]["a"], models[3]["a"])
    assert sorted(unpack_model(packed, 0)) == ["a", "b"]
    assert sorted(pack_models([models[0], models[3]])) == ["m0/a", "m0/b", "m1/a", "m1/b"]


class _Fed:
    """A federation of fixed replies (what the steps see of one)."""

    def __init__(self, replies):
        self.replies, self.sites, self.logged = replies, [r.site for r in replies], []
        self.recorder = _Rec()

    def message(self, params, round_, config):
        return {"params": params, "round": round_, **config}

    def send(self, task, data, targets=None):
        return [r for r in self.replies if targets is None or r.site in targets]

    def send_groups(self, task, groups):
        return {k: self.send(task, d, sites) for k, (d, sites) in groups.items()}

    def record_rows(self, round_, rows, task):
        self.logged.append((round_, task, [r.site for r in rows]))
        return [r for r in rows if not r.error]

    def error(self, msg):
        self.logged.append(msg)

    def warning(self, msg):
        self.logged.append(msg)


class _Rec:
    def __init__(self):
        self.errors = []

    def error(self, round_, site, task, msg):
        self.errors.append((round_, site, task, msg))

    def account(self, rows):
        pass


def test_gather_keeps_the_sites_that_sent_the_statistic_and_names_the_others():
    fed = _Fed([_reply("site-1", 1.0, 2), _reply("site-2", 0, 2, error="site-2: 1 image < k_min=5")])
    wf = Workflow(1, {})
    wf.fed = fed
    got = wf.gather("signature", {}, "signature")
    assert list(got) == ["site-1"] and got["site-1"].meta["n_train"] == 2
    assert fed.recorder.errors == [(-1, "site-2", "signature", "site-2: 1 image < k_min=5")]
    assert "site site-2 sent no signature and is left out: site-2: 1 image < k_min=5" in fed.logged


def test_a_cluster_round_sends_each_cluster_its_model_and_returns_the_answers_by_cluster():
    fed = _Fed([_reply("a", 1.0, 1), _reply("b", 2.0, 1), _reply("c", 0, 1, error="c: failed")])
    wf = Workflow(1, {})
    wf.fed = fed
    out = wf.cluster_round(0, "train", {0: {"w": 0}, 1: {"w": 1}}, {0: ["a", "c"], 1: ["b"], 2: []})
    assert {c: [r.site for r in rows] for c, rows in out.items()} == {0: ["a"], 1: ["b"]}
    assert np.allclose(wf.aggregate(out[0])["w"], 1.0)


def test_round_mean_reads_the_replies_as_the_record_summarises_them():
    rows = [Reply("a", {"val_accuracy": 0.5}, {}, {}), Reply("b", {"val_accuracy": float("nan")}, {}, {}),
            Reply("c", {"val_accuracy": 0.7}, {}, {})]
    assert round_mean(rows, "val_accuracy") == pytest.approx(0.6)
    assert round_mean(rows, "accuracy") is None
    assert np.isnan(round_mean([Reply("a", {"x": float("nan")}, {}, {})], "x"))


def test_the_server_validates_the_task_config_once_per_job_not_per_send(tmp_path, monkeypatch):
    """#88: the server re-validated the task config about ten times a job (``Federation.min_clients`` on every
    send). In a FedAvg run of 4 rounds the server side (fedmed.workflows) validates it a bounded number of times,
    however many rounds it sends."""
    import inspect

    import yaml

    import fedmed.core.schema as schema
    from fedmed.config import load_config
    from fedmed.run.experiment import classes_override, prepare_federation
    from fedmed.run.jobspec import job_spec, run_spec_in_process

    raw = {"name": "once", "dataset": {"path": "builtin:digits", "image_size": 8, "max_per_class": 10},
           "federation": {"sites": 2}, "model": {"arch": "resnet9", "width": 4}, "train": {"rounds": 4},
           "references": [], "methods": [{"name": "FedAvg", "workflow": "fedavg"}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    exp = load_config(tmp_path / "c.yaml")
    data = prepare_federation(exp, 0, tmp_path / "data")
    exp = load_config(tmp_path / "c.yaml", classes_override(data, exp))
    calls = []
    real = schema.task_config

    def counted(cfg):
        caller = inspect.stack()[1].filename
        if "/fedmed/workflows/" in caller:
            calls.append(caller.rsplit("/", 1)[1])
        return real(cfg)

    monkeypatch.setattr(schema, "task_config", counted)
    status, _ = run_spec_in_process(job_spec(exp, exp.methods[0], 0), data, tmp_path / "run")
    assert status == "finished"
    assert len(calls) <= 3, calls  # the workflow's typed config, its initial model, the simulated sites' policy


def test_the_servers_math_does_not_depend_on_the_order_sites_answer(tmp_path, monkeypatch):
    """#88 item 6: Flux's DBSCAN ``eps`` and silhouette differed in the 14th digit between a part alone and inside
    ``make demo``: the server summed the sites' descriptors in the order they arrived. The replies are now read in the
    federation's site order (the shared PCA runs on one BLAS thread, c8e5a60), so the average sees the sites in one
    order and sites answering in the reverse order give the same clustering and models bit for bit (the order check
    fails when ``Workflow.send`` keeps the arrival order)."""
    import torch

    from fedmed.run.jobspec import job_spec, run_spec_in_process
    from fedmed.workflows.base import Workflow
    from fedmed.workflows.inprocess import InProcessFederation
    from tests.test_stopping import _federation

    seen = []
    averaged = Workflow.aggregate
    monkeypatch.setattr(Workflow, "aggregate", lambda self, rows, *a, **k: (
        seen.append([r.site for r in rows]), averaged(self, rows, *a, **k))[1])

    exp, data = _federation(tmp_path, methods=[{"name": "Flux", "workflow": "flux"}],
                            federation={"sites": 4}, train={"lr": 0.05, "rounds": 5, "stop": {"patience": None}})

    def run(out):
        status, fed = run_spec_in_process(job_spec(exp, exp.methods[0], 0), data, out)
        assert status == "finished", fed.recorder.doc.get("reason")
        models = {p.name: torch.load(p, weights_only=True)["state_dict"] for p in sorted((out / "models").glob("*.pt"))}
        return fed.recorder.doc["clustering"], models

    want_clusters, want_models = run(tmp_path / "a")
    assert seen and all(order == sorted(order) for order in seen)
    seen.clear()
    real = InProcessFederation.send_groups
    monkeypatch.setattr(InProcessFederation, "send_groups",
                        lambda self, t, g: {k: rows[::-1] for k, rows in real(self, t, g).items()})
    got_clusters, got_models = run(tmp_path / "b")
    assert seen and all(order == sorted(order) for order in seen), seen  # reversed on arrival, read in site order
    assert "eps" in want_clusters  # the density rule, whose eps moved in the 14th digit
    assert {k: got_clusters.get(k) for k in ("eps", "silhouette", "clusters")} == \
        {k: want_clusters.get(k) for k in ("eps", "silhouette", "clusters")}
    assert got_models.keys() == want_models.keys() and want_models
    for name, sd in want_models.items():
        assert all(torch.equal(sd[k], got_models[name][k]) for k in sd), name
