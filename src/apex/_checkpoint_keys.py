"""The keys amp adds to an optimizer's checkpoint. Written by ``apex.amp`` and read both by amp and by the apex
optimizers when they load before ``amp.initialize``; kept here, outside both packages, so that neither has to
import the other to agree on them."""

#: the fp32 master weights of an O2 optimizer (apex.amp's key), one entry per param, None where a param is its own
AMP_MASTERS_KEY = "apex_amp_master_params"
#: amp's loss scalers, in `amp.state_dict()`'s format: code that saves and loads only the optimizer
#: (transformers' Trainer, DeepSpeed) resumes with the loss scale it stopped at
AMP_SCALERS_KEY = "apex_amp_loss_scalers"
