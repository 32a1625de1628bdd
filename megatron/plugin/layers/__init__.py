"""The model-side pieces every schedule shares, below the pipeline runtime and the Megatron glue:
the document attention (packed rows, K/V context, blockwise kernels), the K/V store, the
sequence-parallel norm, RNG capture, saved-tensor memory accounting and the collective device.
Nothing here imports the pipeline runtime or the plugin's Megatron glue."""
