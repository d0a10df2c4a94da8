"""Run NVIDIA's tritonclient, unmodified, against a server: python tritonclient_check.py ADDRESS IN.npz OUT.npz

Runs in its own virtual environment (.venv-tritonclient): tritonclient needs protobuf < 7 and
registers the same `inference.*` protobuf symbols as our stubs, so it cannot share a process
with them. IN.npz holds, per case, `<case>.<model>.query/key/value[/mask]`; OUT.npz gets
`<case>.output` and `<case>.attn_probs`, plus a JSON report of the metadata calls.
"""

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient


def main(address: str, inputs_path: str, outputs_path: str) -> None:
    client = grpcclient.InferenceServerClient(url=address)
    report = {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "server": client.get_server_metadata(as_json=True),
        "models": {},
    }
    data = np.load(inputs_path)
    cases = sorted({key.rsplit(".", 1)[0] for key in data.files})
    results = {}
    for case in cases:
        _, model = case.split(".")
        if model not in report["models"]:
            report["models"][model] = {
                "ready": client.is_model_ready(model),
                "metadata": client.get_model_metadata(model, as_json=True),
                "config": client.get_model_config(model, as_json=True),
            }
        inputs = []
        for name, datatype in (("query", "FP32"), ("key", "FP32"), ("value", "FP32"), ("mask", "BOOL")):
            if f"{case}.{name}" not in data.files:
                continue
            array = data[f"{case}.{name}"]
            tensor = grpcclient.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        outputs = [grpcclient.InferRequestedOutput("output"), grpcclient.InferRequestedOutput("attn_probs")]
        result = client.infer(model, inputs, outputs=outputs, request_id=case)
        results[f"{case}.output"] = result.as_numpy("output")
        results[f"{case}.attn_probs"] = result.as_numpy("attn_probs")
    for model in report["models"]:
        report["models"][model]["statistics"] = client.get_inference_statistics(model, as_json=True)
    np.savez(outputs_path, **results, report=np.array(json.dumps(report)))


if __name__ == "__main__":
    main(*sys.argv[1:4])
