# Writes the generated fuzz seeds: mlp-small.onnx (mlp.onnx's structure, 8-wide hidden
# layers) and the training-data seeds for it. Run with the venv that has onnx, numpy and
# safetensors:  python fuzz/seeds/make_seeds.py [PATH/TO/mlp.onnx]
# The stage modules and the checkpoint come from the CLI (docs/fuzzing.md#seeds).
import onnx, numpy as np, zipfile, io, os, sys
from onnx import helper, numpy_helper, TensorProto
S=os.path.dirname(os.path.abspath(__file__))
m=onnx.load(sys.argv[1] if len(sys.argv) > 1 else os.path.join(S, '../../../shared/corpus/models/mlp.onnx'))
# mlp.onnx's structure (Gemm, Relu, Gemm, Gelu, Gemm, Relu, Gemm) with 8-wide hidden layers,
# so a seed is 2 KB instead of 600 KB.
rng=np.random.default_rng(0)
dims={'0.weight':(8,64),'0.bias':(8,),'2.weight':(8,8),'2.bias':(8,),'4.weight':(8,8),'4.bias':(8,),'6.weight':(10,8),'6.bias':(10,)}
inits=[numpy_helper.from_array((rng.standard_normal(d)*0.1).astype(np.float32),n) for n,d in dims.items()]
del m.graph.initializer[:]
m.graph.initializer.extend(inits)
del m.graph.value_info[:]
onnx.checker.check_model(m)
onnx.save(m,S+'/onnx/mlp-small.onnx')
def npy(a):
    b=io.BytesIO(); np.save(b,a); return b.getvalue()
for name,a in [('f32',np.arange(12,dtype=np.float32).reshape(3,4)),('i64',np.array([1,2,3],dtype=np.int64)),('u8',np.arange(6,dtype=np.uint8).reshape(2,3)),('bool',np.array([[True,False]])),('f64',np.array([[1.5]],dtype=np.float64)),('i32',np.array([7,8],dtype=np.int32))]:
    open(f'{S}/npy/{name}.npy','wb').write(npy(a))
x=rng.standard_normal((4,64)).astype(np.float32); y=np.array([1,2,3,4],dtype=np.int64)
for comp,tag in [(zipfile.ZIP_STORED,'stored'),(zipfile.ZIP_DEFLATED,'deflated')]:
    with zipfile.ZipFile(f'{S}/npz/mlp-{tag}.npz','w',comp) as z:
        # A fixed timestamp: the same bytes on every run.
        for name,a in [('input.npy',x),('label.npy',y)]:
            z.writestr(zipfile.ZipInfo(name,date_time=(2026,1,1,0,0,0)),npy(a),compress_type=comp)
import safetensors.numpy as stn
stn.save_file({'input':x,'label':y},f'{S}/safetensors/mlp.safetensors')
stn.save_file({'input':x[:2,:].astype(np.float64),'label':y[:2].astype(np.int32)},f'{S}/safetensors/mlp-wrong-dtypes.safetensors')
