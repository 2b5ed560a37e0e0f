"""The contract of a method, fedmed's own and a plugin's alike, and the registry of methods: a method is a config
model (its options, defined once, with their defaults) that says which server workflow runs it, which site tasks it
uses, and what it hands to each (:class:`Method`).

* :meth:`Method.workflow_options` — the options its server workflow (``fedmed.workflows``) is constructed with;
* :meth:`Method.task_options` — what it adds to the task config every site receives (``fedmed.core.schema``; a
  section there holds no default of its own for a method option: the value always comes from here);
* class attributes: ``server`` (the workflow class, or ``"module:Class"`` under ``fedmed.workflows``), ``serves``
  (classification and/or segmentation), ``site_tasks``, ``clustered`` (ends with one model per cluster), ``onboards``
  (a new site is given a model after training; the workflow class says how: ``assign_new_sites``).

**A method of your own** (a plugin): subclass :class:`Method` in a module of your own with a ``workflow`` literal and
a server workflow (a :class:`fedmed.workflows.Workflow` subclass), register it with :func:`register_method`, and
name the module in the experiment config (``plugins: [my_method.py]``, a file relative to the config, or an
importable module). The module is imported when the config is read (where the job is built), by the server and by
every site (the job carries its source, as it carries a user's network class: ``custom/fedmed_user_code/``, and a
site imports it only when its policy lists it, ``fedmed_policy.json`` ``modules``). Site tasks of its own it registers
with :func:`fedmed.site.tasks.register_task`. ``docs/architecture.md`` has a complete example.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar, Literal, Optional, Union

from pydantic import Field

from fedmed.core.errors import FedmedError
from fedmed.core.plugins import PluginError, add_code_folder, import_plugins, module_allowed
from fedmed.core.schema import Strict
from fedmed.workflows.fedavg import FedAvg

__all__ = ["METHODS", "Method", "MethodError", "PluginError", "check_encoder", "check_vit_input", "clustering_workflows",
           "load_plugins", "method_class", "method_union", "on_register", "plugin_module", "register_method",
           "server_workflow_path", "workflows_for"]

CLASSIFY_TASKS = ("train", "validate")


class MethodError(FedmedError, ValueError):
    """A method that cannot be registered or found; one line naming it."""


class Method(Strict):
    """A method of an experiment config (``methods:``): its name, its ``workflow`` and its options.

    Subclasses set ``workflow: Literal["..."]`` and the class attributes below, and override the two hooks when the
    method hands options on."""

    name: str = Field(min_length=1)

    server: ClassVar = FedAvg  # the server workflow: a Workflow subclass (or "module:Class" of a plugin's)
    serves: ClassVar[tuple] = ("classification",)  # the dataset tasks it runs on
    site_tasks: ClassVar[tuple] = CLASSIFY_TASKS  # the site tasks it sends
    clustered: ClassVar[bool] = False  # ends with one model per cluster
    onboards: ClassVar[bool] = False  # a new site is given a model after training (the workflow's assign_new_sites)
    plugin: ClassVar[Optional[str]] = None  # the module a plugin method comes from (set by register_method)
    ssl_role: ClassVar[Optional[str]] = None  # its part in `fedmed ssl` (001_): "pretrain", "finetune", "clusters"
    site_options_model: ClassVar[Optional[type]] = None  # a pydantic model of what its own site tasks read
    # what a site serves besides the server's models: None (the server's), "kept" (FedBN: the site keeps its own
    # batch-norm layers after the run, so a serving plan can score its personal model there), "not_kept" (a model
    # made at the site and gone with the run: Ditto's personal model, a local fine-tuning)
    personal: ClassVar[Optional[str]] = None

    def site_options(self, exp, seed: int) -> dict:
        """The values of :attr:`site_options_model` for a run: they travel in the task config's ``method_options``,
        validated by that model where the job is built and again at the site (:meth:`options_at_site`)."""
        return {}

    @classmethod
    def options_at_site(cls, cfg):
        """The method's site options as a site task reads them: ``cfg.method_options`` validated by the method's own
        model (its defaults for what the job leaves out)."""
        if cls.site_options_model is None:
            raise MethodError(f"method {getattr(cls, '__name__', cls)}: no site_options_model")
        from fedmed.core.schema import task_config

        return cls.site_options_model.model_validate(dict(task_config(cfg).method_options))

    def workflow_options(self, exp, seed: int) -> dict:
        """The keyword options of its server workflow for a run of ``exp`` with ``seed``."""
        return {}

    def task_options(self, exp, seed: int) -> dict:
        """What it adds to the task config every site receives (sections of :class:`fedmed.core.schema.TaskConfig`)."""
        return {}

    @property
    def weights_file(self) -> Optional[str]:
        """A local weights file the method names (its encoder's), or None."""
        return None

    @property
    def site_weights(self) -> Optional[str]:
        """The weights file every site holds in its weights folder and the task config names (its encoder's); None
        when the method names none, or when its file is the server's own (:meth:`server_files`)."""
        return self.weights_file

    def server_files(self) -> list[tuple[str, str, str]]:
        """``(local file, folder of the job's server files, file name there)`` of each file the server starts from
        (e.g. a fine-tuning run's pre-trained encoder); copied into the job when it is built."""
        return []

    def check_experiment(self, exp) -> None:
        """Raise ``ValueError`` (one line naming the method) when ``exp`` cannot run this method; called when the
        config is validated. The base checks the dataset task against :attr:`serves`."""
        seg = exp.dataset.task == "segmentation"
        if "classification" not in self.serves and not seg:
            raise ValueError(f"method {self.name!r}: workflow {self.workflow!r} needs dataset.task: segmentation")
        if seg and "segmentation" not in self.serves:
            raise ValueError(f"method {self.name!r}: workflow {self.workflow!r} is for classification, not "
                             f"segmentation")

    def check_files(self, exp) -> None:
        """Raise ``ValueError`` when a file the method names is missing or does not fit (before any run)."""
        w = self.weights_file
        if w and not Path(w).is_file():
            raise ValueError(f"method {self.name!r}: weights file {w} not found")

    @classmethod
    def training_assignment(cls, doc: dict) -> dict:
        """site -> cluster after a finished training run, from its record (``metrics.json``), for a run that kept no
        ``onboarding.json``: one cluster by default."""
        return {s: 0 for s in doc["rounds"][-1]["sites"]} if doc.get("rounds") else {}


def check_encoder(name: str, weights: Optional[str], *, in_channels: int = 1, image_size: Optional[int] = None) -> None:
    """An unknown encoder, a missing or mismatched weights file: ``ValueError`` before anything is sent."""
    from fedmed.nn.encoders import ENCODERS, build_encoder

    if name not in ENCODERS:
        build_encoder(name)  # EncoderError (a ValueError) naming it
    if weights:
        if not Path(weights).is_file():
            raise ValueError(f"encoder {name}: weights file {weights} not found")
        build_encoder(name, weights=weights, in_channels=in_channels, image_size=image_size)


def check_vit_input(method, exp) -> None:
    """The ViT of Fed-MAE and fine-tuning (``model.arch: vit_small`` too) takes 32 x 32 images."""
    if exp.dataset.task != "segmentation" and exp.dataset.image_size != 32:
        raise ValueError(f"method {method.name!r}: the Fed-MAE / fine-tuning ViT (fedmed.nn.mae.VIT_SMALL, patch 4) "
                         f"takes 32 x 32 images; set dataset.image_size: 32 (got {exp.dataset.image_size})")



# --------------------------------------------------------------------------------------------- the registry

def workflow_name(cls) -> str:
    """The ``workflow`` literal of a method class."""
    field = cls.model_fields.get("workflow")
    args = getattr(field.annotation, "__args__", ()) if field is not None else ()
    if len(args) != 1 or not isinstance(args[0], str):
        raise MethodError(f"{cls.__name__}: a method class declares workflow: Literal['<name>']")
    return args[0]


METHODS: dict[str, type] = {}  # workflow name -> method class; each method's module registers its own
_listeners: list = []  # called after a registration (fedmed.config rebuilds its methods union)


def register_method(cls: type) -> type:
    """Add a method class (a :class:`Method` subclass with a ``workflow`` literal and a ``server`` workflow) to the
    methods an experiment config may name; usable as a class decorator. Registering the same class again is a no-op;
    another class under a workflow name already taken is refused."""
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise MethodError(f"{cls!r} is not a fedmed.methods.Method subclass")
    name = workflow_name(cls)
    known = METHODS.get(name)
    if known is not None and known is not cls:
        if known.__qualname__ == cls.__qualname__ and known.__module__ == cls.__module__:
            METHODS[name] = cls  # the same module imported again (a plugin loaded by path)
        else:
            raise MethodError(f"workflow {name!r} is taken by {known.__module__}.{known.__qualname__}")
    server = cls.server
    if not (isinstance(server, str) and ":" in server) and not isinstance(server, type):
        raise MethodError(f"{cls.__name__}.server should be a Workflow class or 'module:Class', got {server!r}")
    if cls.__module__.split(".")[0] != "fedmed":
        cls.plugin = cls.__module__
    METHODS[name] = cls
    for f in _listeners:
        f()
    return cls


def on_register(callback) -> None:
    """Call ``callback()`` after every registration (``fedmed.config`` rebuilds its ``methods:`` type)."""
    _listeners.append(callback)


def method_class(workflow: str) -> type:
    if workflow not in METHODS:
        raise MethodError(f"workflow {workflow!r} is not a registered method ({', '.join(sorted(METHODS))}); a "
                          f"plugin method's module goes in the config's plugins:")
    return METHODS[workflow]


def method_union():
    """The type of one entry of ``methods:``: the registered method classes, told apart by ``workflow``."""
    classes = tuple(METHODS.values())
    return Annotated[Union[classes], Field(discriminator="workflow")] if len(classes) > 1 else classes[0]


def server_workflow_path(cls) -> str:
    """The server workflow of a method class as the job names it: ``module:Class``."""
    s = cls.server
    if isinstance(s, str):
        return s
    return f"{s.__module__}:{s.__qualname__}"


def workflows_for(task: str) -> tuple:
    """The workflows that run on a dataset of ``task`` ("classification" or "segmentation")."""
    return tuple(w for w, c in METHODS.items() if task in c.serves)


def clustering_workflows() -> tuple:
    return tuple(w for w, c in METHODS.items() if c.clustered)


# --------------------------------------------------------------------------------------------- plugins

def plugin_module(ref: str, base: Path | None = None) -> tuple[str, Path | None]:
    """(module name, source file or None) of a plugin reference: a ``.py`` file (relative to ``base``, the config's
    folder) or a module name."""
    if ref.endswith(".py"):
        path = Path(ref) if Path(ref).is_absolute() or base is None else Path(base) / ref
        if not path.is_file():
            raise PluginError(f"plugins: {ref}: file not found" + (f" (relative to {base})" if base else ""))
        return path.stem, path.resolve()
    return ref, None


def load_plugins(refs, base: Path | None = None, modules=("*",)) -> list[str]:
    """Import each plugin (a module name, or a ``.py`` file relative to ``base``) — only a module ``modules`` allows
    (``("*",)``: the coordinator's own config) — so that its methods and site tasks register. Returns the module
    names."""
    names = []
    for ref in refs or ():
        name, path = plugin_module(str(ref), base)
        if path is not None and module_allowed(name, modules):
            add_code_folder(path.parent)
        import_plugins([name], modules)
        names.append(name)
    return names
