"""What each part of set 1 asks the student to write, so its check refuses labkit's and torch's own.

A check traps each of these while the student's code runs (``core.forbid``); the grader
installs the traps before any student code (``labkit.grading.harness``).
"""

# global_grad_norm: every function that computes the norm
NORM_FUNCS = ("labkit.grad_norm", "labkit.clip_grad_norm_", "labkit.clip.per_tensor_norms",
              "torch.nn.utils.clip_grad_norm_", "torch.nn.utils.get_total_norm")

# clip_to_norm_: every function that clips
CLIP_FUNCS = ("labkit.clip_grad_norm_", "labkit.clip_grads_with_norm_", "torch.nn.utils.clip_grad_norm_",
              "torch.nn.utils.clip_grads_with_norm_")

# skip_reason and guarded_step: the step that decides and does it
STEP_FUNCS = ("labkit.TrainStep",)

# next_scale: the rule itself, and the scalers that run it
SCALE_FUNCS = ("labkit.update_scale", "labkit.GradScaler", "torch.amp.GradScaler")
