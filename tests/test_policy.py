"""The site decides (fedmed.core.policy): what a job can make a site import, download, read and send. Each test runs a
site as a hospital would have it — its own policy file or none (the defaults) — against a job that asks for more."""

import http.server
import json
import re
import sys
import threading

import numpy as np
import pytest
import torch

from fedmed.core.policy import POLICY_FILE, PolicyError, SitePolicy, load_policy, weights_ref
from fedmed.data.images import discover
from fedmed.data.datalists import write_site_datalists
from fedmed.data.partition import iid_partition
from fedmed.nn.train import get_params
from fedmed.site.reply import answer
from fedmed.site.runner import SiteRunner
from fedmed.site.settings import resolve_site_settings, settings_for_dir

CLASSES = [str(c) for c in range(10)]
CFG = {"task": "classification", "seed": 0, "classes": CLASSES, "data": {"image_size": 8, "channels": 1, "n_classes": 10},
       "model": {"arch": "resnet9", "width": 4, "norm": "group"}, "train": {"local_epochs": 1, "batch_size": 8},
       "privacy": {"k_min": 5}, "plugins": ["fedmed.methods.fmcl"]}  # the method's module, as a job names it

# a module whose import leaves a mark: "imported" proves a job made the site run its code
MARKING_MODULE = '''
import pathlib
pathlib.Path({mark!r}).write_text("imported")
from torch import nn


class Net(nn.Module):
    def __init__(self, in_channels=1, num_classes=2):
        super().__init__()
        self.fc = nn.Linear(in_channels * 64, num_classes)

    def forward(self, x):
        return self.fc(x.flatten(1))
'''


@pytest.fixture
def sites(tmp_path):
    pool = discover("builtin:digits", max_per_class=8)
    root = tmp_path / "data"
    write_site_datalists(pool, iid_partition(len(pool.labels), 2, 0), root, test_fraction=0.25, seed=0)
    return root


def site(root, name="site-1", policy=None):
    return SiteRunner(name, settings_for_dir(name, root, policy=policy or SitePolicy()))


@pytest.fixture
def marking_module(tmp_path, monkeypatch):
    code = tmp_path / "code"
    code.mkdir()
    mark = tmp_path / "mark.txt"
    (code / "hospital_mod.py").write_text(MARKING_MODULE.format(mark=str(mark)))
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.delitem(sys.modules, "hospital_mod", raising=False)
    return mark


# ------------------------------------------------------------------------------------------------ the policy file
def test_a_policy_file_is_read_and_every_bad_key_is_one_line(tmp_path):
    f = tmp_path / POLICY_FILE
    f.write_text(json.dumps({"modules": ["hospital_nets"], "weights_dir": "weights", "k_min": 10, "max_epsilon": 2,
                             "dp_required": True, "max_image_pixels": 1000}))
    p = SitePolicy.from_file(f)
    assert p.modules == ("hospital_nets",) and p.weights_dir == tmp_path / "weights" and p.k_min == 10
    assert p.max_epsilon == 2.0 and p.dp_required and p.limits.max_image_pixels == 1000
    for doc, says in (({"k_min": 0}, "k_min should be a positive integer"), ({"modules": "x"}, "modules should be a list"),
                      ({"max_epsilon": -1}, "max_epsilon should be a number > 0"), ({"kmin": 3}, "unknown keys ['kmin']"),
                      ({"dp_required": "yes"}, "dp_required should be true or false")):
        f.write_text(json.dumps(doc))
        with pytest.raises(PolicyError, match=re.escape(says)):
            SitePolicy.from_file(f)


def test_the_policies_and_the_authorization_the_docs_show_are_what_the_code_reads():
    from conftest import doc_json

    full = doc_json("privacy.md", "## What a site controls")
    p = SitePolicy.from_dict(full)
    defaults = SitePolicy().to_dict()  # the page says: the defaults but for weights_dir and k_min
    assert {k: v for k, v in p.to_dict().items() if k not in ("weights_dir", "k_min")} == \
        {k: v for k, v in defaults.items() if k not in ("weights_dir", "k_min")}
    hospital = SitePolicy.from_dict(doc_json("deployment.md", "**fedmed's site policy.**"))
    assert hospital.modules == ("hospital_nets",) and hospital.dp_required and hospital.max_epsilon == 4
    assert hospital.refused_tracking(["https://mlflow.hospital-network.org"]) is None
    assert hospital.refused_tracking(["https://elsewhere.example.org", "wandb:online"])
    authz = doc_json("deployment.md", "`<site kit>/local/authorization.json`")
    assert all(r["byoc"] == "none" for r in authz["permissions"].values())  # used as written by test_deployment.py


def test_a_kit_policy_sits_beside_the_site_settings_and_a_kit_without_one_runs_the_defaults(tmp_path, sites):
    kit = tmp_path / "kit"
    (kit / "local").mkdir(parents=True)
    (kit / "startup").mkdir()
    (kit / "local" / "fedmed_site.json").write_text(json.dumps({"datalist": str(sites / "site-1.json"), "k_min": 7}))
    s = resolve_site_settings("site-1", cwd=kit, env={})
    assert s.policy.source == "default" and s.policy.k_min == 7  # fedmed_site.json's k_min raises the floor
    (kit / "local" / POLICY_FILE).write_text(json.dumps({"k_min": 12, "allow_per_image": True}))
    s = resolve_site_settings("site-1", cwd=kit / "run", env={})
    assert s.policy.source == POLICY_FILE and s.policy.k_min == 12 and s.policy.allow_per_image
    assert load_policy(env={}, cwd=tmp_path).source == "default"


# ------------------------------------------------------------------------------------------------ 1. code
def test_a_module_a_job_names_is_not_imported_without_the_sites_policy(sites, marking_module):
    cfg = {**CFG, "model": {"arch": "hospital_mod:Net"}}
    runner, (_, metrics, meta, out), err = answer("site-1", None, "train", {}, cfg, 0,
                                             settings=settings_for_dir("site-1", sites, policy=SitePolicy()))
    assert "model.arch 'hospital_mod:Net' imports module 'hospital_mod', which this site does not allow" in meta["error"]
    assert "modules" in meta["error"] and "\n" not in meta["error"]
    assert not marking_module.exists() and "hospital_mod" not in sys.modules  # never imported
    # the site lists it: then it runs
    allowed = site(sites, policy=SitePolicy(modules=("hospital_mod",)))
    model = allowed.model(cfg)
    assert marking_module.exists() and type(model).__name__ == "Net"


def test_a_checkpoint_cannot_make_predict_import_a_module(tmp_path, marking_module):
    from fedmed.nn.predict import ModelFileError, load_model, save_model

    cfg = {"task": "classification", "model": {"arch": "hospital_mod:Net"}, "data": {"channels": 1, "n_classes": 2}}
    f = save_model(tmp_path / "m.pt", {"fc.weight": np.zeros((2, 64), np.float32), "fc.bias": np.zeros(2, np.float32)},
                   cfg)
    with pytest.raises(ModelFileError, match="imports module 'hospital_mod', which this site does not allow"):
        load_model(f, policy=SitePolicy())
    assert not marking_module.exists() and "hospital_mod" not in sys.modules
    net, _ = load_model(f, policy=SitePolicy(modules=("hospital_mod",)))
    assert type(net).__name__ == "Net"


def test_the_server_imports_no_module_its_policy_does_not_allow(sites, tmp_path, marking_module):
    from fedmed.workflows import InProcessFederation
    from fedmed.workflows.fedavg import FedAvg

    cfg = {**CFG, "model": {"arch": "hospital_mod:Net"}, "federation": {"sites": ["site-1", "site-2"]}}
    fed = InProcessFederation(sites, ["site-1", "site-2"], tmp_path / "run", log=None, policy=SitePolicy())
    assert fed.run(FedAvg(1, cfg)) == "failed"
    assert "imports module 'hospital_mod'" in fed.recorder.doc["reason"]
    assert not marking_module.exists()


def test_a_site_may_restrict_the_networks_and_encoders_it_runs(sites):
    p = SitePolicy(architectures=("resnet9",), encoders=("random_cnn",))
    r = site(sites, policy=p)
    with pytest.raises(PolicyError, match="model.arch 'DenseNet121' is not among the networks this site runs"):
        r.handle("train", {}, {**CFG, "model": {"arch": "DenseNet121"}})
    sig = {"kind": "fmcl", "encoder": "vit_tiny", "seed": 0}
    with pytest.raises(PolicyError, match="encoder 'vit_tiny' is not among the encoders this site runs"):
        r.handle("signature", {}, {**CFG, "signature": sig})
    _, _, meta, _ = r.handle("signature", {}, {**CFG, "signature": {**sig, "encoder": "random_cnn"}})
    assert meta["classes"]


def test_every_encoder_and_network_a_task_builds_is_the_one_the_policy_checks(sites):
    """2D lesion ``assess`` embeds with EfficientNet-Lite0 (3D ``assess`` with MedicalNet): the policy checks the encoder
    that task builds, not another; a Fed-MAE ``train`` builds MONAI's MaskedAutoEncoderViT whatever model.arch says, so
    a site that runs only ResNet-9 refuses it. Each refusal comes before any data is read or network built."""
    from conftest import mae_section

    from fedmed.core.schema import task_config
    from fedmed.site.mae import MAESiteRunner
    from fedmed.site.seg import SegSiteRunner
    from fedmed.site.seg2d import Seg2DSiteRunner

    def runner(cls, policy):
        return cls("site-1", settings_for_dir("site-1", sites, policy=policy))

    seg2d = {"task": "segmentation", "seed": 0, "data": {"spatial_dims": 2, "image_size": 16, "in_channels": 1},
             "model": {"arch": "unet", "channels": [4, 8]}, "privacy": {"k_min": 2}}
    with pytest.raises(PolicyError, match="encoder 'efficientnet_lite0' is not among the encoders this site runs "
                                          r"\(encoders of this site's policy .*: \['medicalnet_resnet18'\]\)"):
        runner(Seg2DSiteRunner, SitePolicy(encoders=("medicalnet_resnet18",))).handle("assess", {}, seg2d)
    with pytest.raises(PolicyError, match="encoder 'medicalnet_resnet18' is not among"):
        runner(SegSiteRunner, SitePolicy(encoders=("efficientnet_lite0",))).handle(
            "assess", {}, {**seg2d, "data": {"in_channels": 1, "shape": [16, 16, 16], "roi": [16, 16, 16]}})
    ok = runner(Seg2DSiteRunner, SitePolicy(encoders=("efficientnet_lite0",)))
    ok.check_policy("assess", task_config(seg2d))  # allowed: no error
    mae = {**CFG, "task": "mae", "data": {**CFG["data"], "image_size": 32}, "method_options": mae_section(1)}
    with pytest.raises(PolicyError, match="the network Fed-MAE pre-trains \\(whatever model.arch says\\) 'MaskedAutoEncoderViT' is not among the networks this site runs "
                                          r"\(architectures of this site's policy .*: \['resnet9'\]\)"):
        runner(MAESiteRunner, SitePolicy(architectures=("resnet9",))).handle("train", {}, mae)


# ------------------------------------------------------------------------------------------------ 2. network
class Listener:
    """A loopback HTTP server that records every request it gets (nothing may reach it)."""

    def __init__(self):
        self.requests = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests.append(self.path)
                self.send_response(404)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture
def listener():
    lis = Listener()
    yield lis
    lis.close()


DOWNLOADING_NET = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, in_channels=1, num_classes=2, url=None):
        super().__init__()
        self.fc = nn.Linear(in_channels * 64, num_classes)
        torch.hub.load_state_dict_from_url({url!r})

    def forward(self, x):
        return self.fc(x.flatten(1))
'''


def test_no_config_or_checkpoint_reaches_the_network(sites, tmp_path, listener, monkeypatch):
    from fedmed.nn.models import ArchError, model_from_config
    from fedmed.nn.predict import ModelFileError, load_model, save_model

    url = f"{listener.url}/weights.pth"
    r = site(sites)
    # a URL-valued argument (MONAI's HoVerNet pretrained_url) is refused at the site, at the build and in predict
    cfg = {**CFG, "model": {"arch": "HoVerNet", "args": {"pretrained_url": url}}}
    with pytest.raises(ArchError, match="model.args.pretrained_url: HoVerNet would be given a URL or a path"):
        r.model(cfg)
    f = save_model(tmp_path / "hover.pt", {}, {**cfg, "data": {"channels": 1, "n_classes": 2}})
    with pytest.raises(ModelFileError, match="would be given a URL or a path"):
        load_model(f, policy=SitePolicy())
    # EfficientNetBN defaults to pretrained=True (a download): built with it off
    net = model_from_config({"arch": "EfficientNetBN", "args": {"model_name": "efficientnet-b0"}}, 1, 2)
    assert sum(p.numel() for p in net.parameters()) > 1e6
    # a constructor that downloads anyway (a user's class) fails in one line, before any request
    code = tmp_path / "code"
    code.mkdir()
    (code / "downloading.py").write_text(DOWNLOADING_NET.format(url=url))
    monkeypatch.syspath_prepend(str(code))
    with pytest.raises(ArchError, match="tried to download"):
        model_from_config({"arch": "downloading:Net"}, 1, 2, modules=("downloading",))
    # a path as an argument (a file of the site's host) is refused too
    with pytest.raises(ArchError, match="model.args.pretrained: .* a URL or a path"):
        model_from_config({"arch": "ResNet", "args": {"pretrained": "/etc/hostname",
                          "block": "basic", "layers": [1, 1, 1, 1], "block_inplanes": [4, 8, 16, 32]}}, 1, 2)
    assert listener.requests == []


# ------------------------------------------------------------------------------------------------ 3. files
def test_a_weights_path_outside_the_sites_folder_is_refused_without_touching_the_file(sites, tmp_path):
    from fedmed.nn.encoders import build_encoder

    secret = tmp_path / "secret" / "enc.pt"
    secret.parent.mkdir()
    torch.save(build_encoder("random_cnn", seed=1).module.state_dict(), secret)
    ref = weights_ref(secret)
    folder = tmp_path / "site_weights"
    folder.mkdir()
    r = site(sites, policy=SitePolicy(weights_dir=folder))
    opened = []

    def hook(event, args):
        if event in ("open", "os.listdir", "os.scandir") and args and "secret" in str(args[0]):
            opened.append((event, args[0]))

    sys.addaudithook(hook)  # Python's audit events: every open() of that file would be seen
    sig = {"kind": "fmcl", "encoder": "random_cnn", "seed": 0}
    for name, kind in ((str(secret), "absolute path"), ("../secret/enc.pt", "path"), ("C:\\secret\\enc.pt", "absolute"),
                       ("~/enc.pt", "home-relative")):
        with pytest.raises(PolicyError, match=f"not by a path \\(got a {kind}"):
            r.handle("signature", {}, {**CFG, "signature": sig, "encoder_weights": {**ref, "name": name}})
    assert opened == []
    # the file named by name, in the site's weights folder: used; another file under that name: refused
    with pytest.raises(PolicyError, match="the weights file enc.pt is not in this site's weights folder"):
        r.handle("signature", {}, {**CFG, "signature": sig, "encoder_weights": ref})
    (folder / "enc.pt").write_bytes(secret.read_bytes())
    _, _, meta, _ = r.handle("signature", {}, {**CFG, "signature": sig, "encoder_weights": ref})
    assert f"enc.pt (sha256 {ref['sha256'][:12]})" in meta["encoder"]
    torch.save(build_encoder("random_cnn", seed=2).module.state_dict(), folder / "enc.pt")
    with pytest.raises(PolicyError, match="enc.pt in this site's weights folder is not the coordinator's"):
        site(sites, policy=SitePolicy(weights_dir=folder)).handle(
            "signature", {}, {**CFG, "signature": sig, "encoder_weights": ref})
    with pytest.raises(PolicyError, match="this site keeps no weights folder"):
        site(sites).handle("signature", {}, {**CFG, "signature": sig, "encoder_weights": ref})


# ------------------------------------------------------------------------------------------------ 4. privacy floor
def _one_image_class(root):
    doc = json.loads((root / "site-1.json").read_text())
    doc["training"][0]["label"] = 9
    for e in doc["training"][1:]:
        e["label"] = 0 if e["label"] == 9 else e["label"]
    (root / "site-1.json").write_text(json.dumps(doc))


def test_a_jobs_k_min_of_1_at_a_default_site_withholds_the_one_image_class(sites):
    _one_image_class(sites)
    job = {**CFG, "privacy": {"k_min": 1}, "signature": {"kind": "fmcl", "encoder": "random_cnn", "seed": 0}}
    _, _, meta, _ = site(sites).handle("signature", {}, job)  # no policy file: the defaults (floor 5)
    assert 9 in meta["withheld_classes"] and 9 not in meta["classes"]
    assert any("privacy.k_min=1 is below this site's floor; this site applies k_min=5" in n for n in meta["notes"])
    assert meta["site_policy"]["k_min"] == 5
    # a site whose own policy allows single images sends it (and says so in its policy)
    _, _, meta, _ = site(sites, policy=SitePolicy(k_min=1)).handle("signature", {}, job)
    assert 9 in meta["classes"]


# ------------------------------------------------------------------------------------------------ DP and epsilon
def test_dp_required_and_the_epsilon_ceiling_are_the_sites(sites):
    sig = {**CFG, "signature": {"kind": "fecfl", "encoder": "random_cnn", "seed": 0}}
    with pytest.raises(PolicyError, match="this site sends signatures only with differential privacy"):
        site(sites, policy=SitePolicy(dp_required=True)).handle("signature", {}, sig)
    with pytest.raises(PolicyError, match="dp_epsilon=5 is above this site's ceiling .*max_epsilon.*: 1"):
        site(sites, policy=SitePolicy(max_epsilon=1.0)).handle("signature", {}, {**sig, "privacy": {"dp_epsilon": 5}})
    r = site(sites, policy=SitePolicy(max_epsilon=3.0))
    dp = {**sig, "privacy": {"dp_epsilon": 2.0}}
    _, _, meta, _ = r.handle("signature", {}, dp)
    assert meta["dp"]["epsilon"] == 2.0 and meta["dp"]["run_epsilon"] == 2.0
    with pytest.raises(PolicyError, match="would bring this run's epsilon at this site to 4, above its ceiling"):
        r.handle("signature", {}, dp)  # a second signature at 2 would compose to 4 > 3: nothing is sent
    assert r.epsilon_spent == 2.0


def test_the_dp_delta_has_a_ceiling_in_the_sites_policy(sites, tmp_path):
    """``dp_required: true, max_epsilon: 1`` means nothing if a job may set ``dp_delta: 0.999999`` (the Gaussian
    noise falls from sigma 1.07 to 0.063): δ has a ceiling too, ``max_delta`` (default 1e-5, fedmed's own dp_delta)."""
    sig = {**CFG, "signature": {"kind": "fecfl", "encoder": "random_cnn", "seed": 0}}
    weak = {**sig, "privacy": {"dp_epsilon": 1.0, "dp_delta": 0.999999}}
    strict = SitePolicy(dp_required=True, max_epsilon=1.0)
    assert strict.max_delta == 1e-5
    r = site(sites, policy=strict)
    with pytest.raises(PolicyError, match=r"the job's privacy.dp_delta=0.999999 is above this site's ceiling "
                                          r"\(max_delta of this site's policy .*: 1e-05\)"):
        r.handle("signature", {}, weak)
    assert r.epsilon_spent == 0.0  # nothing released
    _, _, meta, _ = r.handle("signature", {}, {**sig, "privacy": {"dp_epsilon": 1.0, "dp_delta": 1e-6}})
    assert meta["dp"]["epsilon"] == 1.0
    f = tmp_path / "fedmed_policy.json"
    f.write_text(json.dumps({"max_delta": 1e-3}))
    assert SitePolicy.from_file(f).max_delta == 1e-3 and SitePolicy.from_file(f).summary()["max_delta"] == 1e-3
    for bad in (0, -1e-5, 2.0, "1e-5", True):
        f.write_text(json.dumps({"max_delta": bad}))
        with pytest.raises(PolicyError, match="fedmed_policy.json: max_delta should be a number above 0 and at most 1"):
            SitePolicy.from_file(f)
    sim = SitePolicy.simulating(2)  # fedmed experiment's sites are the experimenter's: the config's delta holds
    assert SitePolicy.from_file(sim.write(tmp_path / "sim.json")).max_delta == 1.0
    sim.check_dp(1.0, 0.5)


def test_a_raw_pixel_signature_without_dp_is_the_sites_choice(sites):
    job = {**CFG, "signature": {"kind": "pacfl", "encoder": "pixels", "seed": 0, "options": {"n_basis": 2}}}
    with pytest.raises(PolicyError, match="allow_pixel_signatures.*false"):
        site(sites).handle("signature", {}, job)
    _, _, meta, _ = site(sites).handle("signature", {}, {**job, "privacy": {"dp_epsilon": 1.0}})
    assert meta["dp"]["epsilon"] == 1.0
    _, _, meta, _ = site(sites, policy=SitePolicy(allow_pixel_signatures=True)).handle("signature", {}, job)
    assert meta["basis"] is not None


def test_the_epsilon_recorded_is_the_composition_of_what_each_site_sent(sites, tmp_path):
    """FMCL with DP: every signature a site sent at epsilon, composed (basic composition) in the record and the report
    (an onboarding without labels — K signatures — : test_onboard.py)."""
    from fedmed.workflows import InProcessFederation
    from fedmed.methods.signature import OneShotClustered

    eps = 0.7
    cfg = {**CFG, "privacy": {"k_min": 2, "dp_epsilon": eps}, "federation": {"sites": ["site-1", "site-2"]}}
    args = {"signature": {"kind": "fmcl", "encoder": "random_cnn", "seed": 0},
            "clustering": {"n_clusters": 2, "threshold": None, "options": {"overlap": True}, "linkage": "average",
                           "k1_silhouette": None}, "fedavg_warmup": 0}
    fed = InProcessFederation(sites, ["site-1", "site-2"], tmp_path / "run", log=None)
    assert fed.run(OneShotClustered(1, cfg, **args)) == "finished"
    doc = fed.recorder.doc
    sent = {s: sum(1 for t in doc["task_log"] if t["task"] == "signature" and s in t["sites"]) for s in fed.sites}
    for s in fed.sites:
        assert doc["epsilon_spent"][s] == {"epsilon": pytest.approx(eps * sent[s]), "releases": sent[s]}
        assert doc["site_policies"][s]["k_min"] == 2
    from fedmed.report.html import privacy_table

    assert f"{eps * sent['site-1']:g} over {sent['site-1']} release(s)" in privacy_table(doc)  # the report shows it


# ------------------------------------------------------------------------------------------------ limits
def test_a_site_sets_the_sizes_it_reads(sites):
    small = {**CFG, "data": {**CFG["data"], "image_size": 4}}  # 16 values a task image: within the limit below
    r = site(sites, policy=SitePolicy.from_dict({"max_image_pixels": 20}))
    with pytest.raises(Exception) as err:  # the 8x8 source images are larger than that: refused when decoded
        r.handle("validate", get_params(r.model(small)), small)
    assert "more than this site decodes (its policy's max_image_pixels=20)" in err.value.public
    r = site(sites, policy=SitePolicy.from_dict({"max_file_bytes": 10}))
    with pytest.raises(Exception) as err:
        r.handle("validate", get_params(r.model(CFG)), CFG)
    assert "larger than this site reads" in err.value.public


def test_a_jobs_image_and_volume_sizes_are_capped_by_the_sites_limits_before_anything_is_allocated(sites, tmp_path):
    """``data.image_size: 60000`` would allocate 14 GB per image, a checkpoint's ``image_size`` 1e6 killed ``fedmed
    predict``: a task's (and a checkpoint's) sizes are checked against the site's read limits first, in one line."""
    import resource
    import subprocess

    from fedmed.nn.predict import ModelFileError, load_model, save_model

    r = site(sites)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for data, msg in (({"image_size": 60000}, r"data.image_size 60000 \(1 channel\(s\)\) is 3600000000 values per "
                       r"image, more than this site allocates \(max_image_pixels of this site's policy"),
                      ({"image_size": 0}, "data.image_size should be a positive number of pixels"),
                      ({"image_size": 6000, "channels": 3}, r"data.image_size 6000 \(3 channel\(s\)\)")):
        with pytest.raises(PolicyError, match=msg):
            r.handle("train", {}, {**CFG, "data": {**CFG["data"], **data}})
    seg = {"task": "segmentation", "seed": 0, "model": {"arch": "unet", "channels": [4, 8]}, "privacy": {"k_min": 2},
           "data": {"in_channels": 2, "shape": [2048, 2048, 1024], "roi": [16, 16, 16]}}
    from fedmed.site.seg import SegSiteRunner

    seg_site = SegSiteRunner("site-1", settings_for_dir("site-1", sites, policy=SitePolicy()))
    with pytest.raises(PolicyError, match=r"data.shape 2048x2048x1024 \(2 channel\(s\)\) is 8589934592 values per "
                                          r"volume, more than this site allocates \(max_volume_voxels"):
        seg_site.handle("train", {}, seg)
    with pytest.raises(PolicyError, match=r"data.roi 4096x4096x16"):
        seg_site.handle("train", {}, {**seg, "data": {**seg["data"], "shape": [16, 16, 16], "roi": [4096, 4096, 16]}})
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: nothing was allocated
    net = get_params(r.model(CFG))
    ck = save_model(tmp_path / "big.pt", net, {**CFG, "data": {**CFG["data"], "image_size": 1_000_000}})
    with pytest.raises(ModelFileError, match=r"big.pt: data.image_size 1000000 .* more than this site allocates"):
        load_model(ck, policy=SitePolicy())
    # a datalist naming a 1.5 GB file: hashed for the split-overlap check in chunks (bounded memory), or not read at
    # all when it is larger than max_file_bytes (refused, naming it, when the images are read)
    big = tmp_path / "huge.png"
    with open(big, "wb") as fh:
        fh.truncate(1_500_000_000)  # sparse: no disk
    doc = {"training": [{"image": str(big), "label": 0}], "validation": [], "test": [{"image": "other.png", "label": 0}]}
    (tmp_path / "dl.json").write_text(json.dumps(doc))
    # the peak of this process's own memory (VmHWM: getrusage's ru_maxrss keeps the forking worker's peak)
    code = ("import re, sys; from fedmed.data.datalists import load_datalist; from fedmed.core.policy import "
            "ReadLimits; load_datalist(sys.argv[1], limits=ReadLimits(max_file_bytes=int(sys.argv[2]))); "
            "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))")
    for limit in (2 * 1024**3, 1_000_000):
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dl.json"), str(limit)], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert int(out.stdout.split()[-1]) < 300_000, out.stdout  # KiB peak: far below the file's 1.5 GB


# ------------------------------------------------------------------------------------------------ 5. names
SECRETS = ("Doe", "MRN12345", "PACS export", "Jane")


def break_with_names(root, site: str, kind: str) -> None:
    doc = json.loads((root / f"{site}.json").read_text())
    e = doc["training"][0]
    if kind == "patient_folder":
        e["image"] = "Doe_Jane_MRN12345/scan.png"
    elif kind == "entry_with_extra_fields":
        doc["training"][0] = {"image": e["image"], "patient_name": "Doe Jane", "mrn": "MRN12345"}  # and no label
    elif kind == "label_value":
        e["label"] = "Doe-Jane-MRN12345"
    elif kind == "windows_path":
        e["image"] = "C:\\PACS export\\Doe Jane\\scan.png"
    (root / f"{site}.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("kind", ["patient_folder", "entry_with_extra_fields", "label_value", "windows_path"])
def test_no_name_of_a_sites_data_reaches_anything_the_server_writes(tmp_path, capfd, kind):
    from fedmed.workflows import InProcessFederation
    from fedmed.workflows.fedavg import FedAvg

    pool = discover("builtin:digits", max_per_class=8)
    root = tmp_path / "data"
    write_site_datalists(pool, iid_partition(len(pool.labels), 3, 0), root, test_fraction=0.25, seed=0)
    break_with_names(root, "site-2", kind)
    server_log = []
    cfg = {**CFG, "federation": {"sites": ["site-1", "site-2", "site-3"], "min_clients": 2}}
    fed = InProcessFederation(root, ["site-1", "site-2", "site-3"], tmp_path / "run", log=server_log.append)
    assert fed.run(FedAvg(2, cfg)) == "finished"
    err = next(e["error"] for e in fed.recorder.doc["errors"] if e["site"] == "site-2")
    assert "training[0]" in err, err  # the position, and the kind of problem
    written = "\n".join(server_log) + "".join(f.read_text(errors="replace") for f in (tmp_path / "run").rglob("*")
                                              if f.is_file() and f.suffix in (".json", ".md", ".html", ".csv"))
    assert not [s for s in SECRETS if s in written], [s for s in SECRETS if s in written]
    assert "Doe" in capfd.readouterr().err  # the site's own log has it


def test_a_jobs_code_folder_cannot_shadow_an_installed_module(tmp_path):
    """A BYOC job's ``custom/fedmed_user_code`` holding ``scipy/__init__.py`` (server) or ``numpy/__init__.py`` (site)
    must not be what ``import scipy`` finds: the folder comes after everything installed (the site executor's
    START_RUN, the server controller, the in-process federation), while the job's own module stays importable."""
    import subprocess

    app = tmp_path / "app"
    code = app / "custom" / "fedmed_user_code"
    for mod in ("scipy", "sklearn", "jobs_own_module"):
        (code / mod).mkdir(parents=True)
        (code / mod / "__init__.py").write_text(
            f"import pathlib\npathlib.Path({str(tmp_path / ('RAN_' + mod))!r}).touch()\n")
    script = f"""
import sys
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from fedmed_flare.executor import SiteExecutor
from fedmed.workflows.federation import Federation
ctx = FLContext()
ctx.set_prop(FLContextKey.APP_ROOT, {str(app)!r}, private=True, sticky=False)
SiteExecutor().handle_event(EventType.START_RUN, ctx)
from fedmed.core.plugins import add_code_folder
add_code_folder({str(code)!r})  # the server's path (controller, in-process federation) calls the same
assert {str(code)!r} in sys.path and sys.path.index({str(code)!r}) == len(sys.path) - 1, sys.path
import scipy, sklearn, jobs_own_module
print(scipy.__file__, sklearn.__file__, jobs_own_module.__file__)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    sci, skl, own = r.stdout.split()[-3:]
    assert str(code) not in sci and str(code) not in skl and own.startswith(str(code))
    assert not (tmp_path / "RAN_scipy").exists() and not (tmp_path / "RAN_sklearn").exists()
    assert (tmp_path / "RAN_jobs_own_module").exists()
