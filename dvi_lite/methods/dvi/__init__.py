"""DVI (Draft -> Verify -> Improve): self-speculative decoding whose draft head learns online from the verifier.

Kangaroo's split (the target's first k layers draft, layers [k, L) verify, the shallow KV cache and
hidden states are shared) plus a learner: every draft token the verifier tests becomes an experience
(h_k, token, reward r = accepted, the verifier's logits), and the draft head trains on them while it
serves. Optional slow updates keep a LoRA on the verifier tracking the stream.

    config.py      DVIConfig: every knob of the learner, validated
    losses.py      lambda schedule, KL / REINFORCE / surrogate / CE terms, fast and slow loss, EMABaseline
    buffer.py      ReplayBuffer of experiences; rng_state / set_rng_state for exact resume
    policy.py      the draft head (DVIPolicy: exit block + lora_S), the verifier's lora_D, load_policy
    drafter.py     DVIDrafter, make_drafter (method="dvi"), evaluate
    learner.py     OnlineTrainer: decode -> buffer -> fast / slow updates
    checkpoint.py  the trainer's checkpoints (trainer.pt, policy.pt)
    cli.py         `python -m dvi_lite dvi`: train on corpus prompts or the Spec-Bench dev question stream
    serve.py       learning while serving on a real model: the question stream, the ablation arms,
                   prepare_smollm2 (the committed SmolLM2 head's recipe)
    ablation.py    `python -m dvi_lite.methods.dvi.ablation`: DVI vs KL-only vs pure RL on one stream;
                   paper_ablation: the same arms as the paper trains them, over seeds, with 95% intervals
    paper.py       DVI as the paper trains it: trained draft LM head, KL warm-start on the self-distillation
                   set (lambda_t phase), online reward phase, learning curve, max_minutes + resume
    widget.py      the lambda_t lab of notebook 05 (ipywidgets + plotly, imported lazily)
    figure.py      the widget's live figure (plotly, imported lazily)

Nothing is imported here: each module is imported on its own (the registry names drafter:make_drafter).
"""
