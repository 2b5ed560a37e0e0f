"""Where a job keeps what it carries — one table, read by the job builder, the FLARE adapters and the workflows.

A fedmed job carries **no code** unless the model is the user's own class. What else it may carry is data for the
*server* (the coordinator's own files): the initial weights of the model, a checkpoint to resume from, a finished
run's models for onboarding, a pre-trained encoder for fine-tuning. Those go into the server app's ``config/``
folder under :data:`FILES_DIR` — not into ``custom/``, which FLARE treats as custom code (BYOC). Sites receive no
files: a weights file a site needs comes from its own weights folder (``fedmed.site.policy``).
"""

__all__ = ["FILES_DIR", "FINETUNE_INIT", "MODEL_INIT", "PLAN", "RESUME", "TRAINING", "USER_CODE_DIR"]

FILES_DIR = "fedmed_files"  # inside the server app's config/ folder (FLARE's app_folder_type="config")
MODEL_INIT = "model_init"  # model.init_weights
RESUME = "resume"  # the checkpoint a resumed job continues from (state.json, models.npz)
TRAINING = "training"  # a finished run's models and onboarding state (the onboarding job)
PLAN = "plan"  # finished runs' models a serving plan chooses among (global/, <candidate>/)
FINETUNE_INIT = "finetune_init"  # the Fed-MAE run's encoder.pt (fine-tuning with init 'fedmae')
USER_CODE_DIR = "fedmed_user_code"  # inside an app's custom/ folder: a user's network class (the job is then BYOC)
