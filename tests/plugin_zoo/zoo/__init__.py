"""A zoo of model modules that break (or should not break) engine startup, for the plugin's tests.

The tests copy this package into pytester's directory and point ``--enginecheck-target`` at
``zoo:MODELS`` (import and inspect checks) or ``zoo.registry:REGISTRY`` (an engine_ref registry:
every check). Nothing here is imported by the project's own test process.
"""

MODELS = {
    # the seed bug: a VL module imports a language model, which imports expert_parallel, which asks
    # torch.cuda.get_device_properties at import time
    "SeedVLForConditionalGeneration": "zoo.seed_vl:SeedVLForConditionalGeneration",
    "ZerosCudaModel": "zoo.cuda_zeros:Model",
    "DotCudaModel": "zoo.cuda_dot_cuda:Model",
    "ToCudaModel": "zoo.cuda_to:Model",
    "SetDeviceModel": "zoo.cuda_set_device:Model",
    "StreamModel": "zoo.cuda_stream:Model",
    "EventModel": "zoo.cuda_event:Model",
    "CurrentDeviceModel": "zoo.cuda_current_device:Model",
    "MemGetInfoModel": "zoo.cuda_mem_get_info:Model",
    "SwallowsCudaModel": "zoo.swallows_cuda:Model",
    "MissingDependencyModel": "zoo.missing_dependency:Model",
    "RaisesModel": "zoo.raises:Model",
    "SegfaultModel": "zoo.segfault:Model",
    "ExitsModel": "zoo.exits:Model",
    "HangsModel": "zoo.hangs:Model",
    "MissingClassModel": "zoo.missing_class:Model",
    "NotAModel": "zoo.not_a_model:Model",
    # these pass the import check
    "DeviceObjectModel": "zoo.ok_device_object:Model",
    "UncalledFunctionModel": "zoo.ok_uncalled:Model",
    "GuardedModel": "zoo.ok_guarded:Model",
    "CachedCapabilityModel": "zoo.ok_cached:Model",
    # these pass, except under --enginecheck-strict
    "QueriesAvailableModel": "zoo.queries_available:Model",
    "QueriesDeviceCountModel": "zoo.queries_device_count:Model",
}

NOT_A_MAPPING = ["zoo.ok_guarded:Model"]  # a target attribute of the wrong type
