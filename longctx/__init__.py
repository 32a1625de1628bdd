"""Long-context pieces shared by the document schedules (``elastic``, ``seq1f1b``, ``sppo``)
and their planners: the cost model, hardware profiles and model presets, chunks of documents,
their packed rows and cost adapter, the spreading of documents over data-parallel replicas,
and the job's cost model from Megatron's flags. No schedule is imported here."""
