#!/usr/bin/python3
"""Hostile input on the plain TCP streams (docs/reliability.md): starts a controller and a worker
from build/bin/pathways, opens 600 connections of garbage to the controller's stream port and the
worker's data port, then runs a tenant's job and checks both processes still serve.

    /usr/bin/python3 tools/hostile_streams.py
"""
import socket, subprocess, time, os, struct, random
B=os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'build', 'bin', 'pathways')
def free():
    s=socket.socket(); s.bind(('127.0.0.1',0)); p=s.getsockname()[1]; s.close(); return p
sp, dp = free(), free()
ctl = subprocess.Popen([B,'controller','--listen','127.0.0.1:0','--stream-port',str(sp)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
addr=None
while addr is None:
    line=ctl.stdout.readline()
    if 'listening on' in line: addr=line.split()[-1]
wk = subprocess.Popen([B,'worker','--controller',addr,'--devices','2','--data-port',str(dp)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
while 'serving' not in wk.stdout.readline():  # registered
    pass
random.seed(1)
sent=0
for port in (sp, dp):
    for kind in range(6):
        for i in range(50):
            try:
                c=socket.create_connection(('127.0.0.1',port),timeout=2)
                if kind==0: c.sendall(os.urandom(random.randint(1,4096)))
                elif kind==1: c.sendall(b'PWFLOW01'+struct.pack('<I',0)+os.urandom(2000))  # admitted (no token), then garbage frames
                elif kind==2: c.sendall(b'PWSCHD01'+struct.pack('<I',0)+struct.pack('<I',0xffffffff))
                elif kind==3: c.sendall(b'PWSCHD01'+struct.pack('<I',0)+struct.pack('<I',100)+os.urandom(100))
                elif kind==4: c.sendall(b'PWFLOW01'+struct.pack('<I',0)+struct.pack('<I',10)+b'\x0a\x03abc'+b'\x1a\x03\x08\x01\x10')
                elif kind==5: c.sendall(b'PWFLOW0')  # half a hello, then silence
                sent+=1
                if kind!=5: c.close()
            except Exception as e:
                print('send error', kind, e)
print('hostile connections', sent)
t = subprocess.run([B,'tenant','--controller',addr,'--devices','2','--runs','20'], capture_output=True, text=True, timeout=120)
print('tenant rc', t.returncode, (t.stdout+t.stderr).strip().splitlines()[-1])
alive = ctl.poll() is None and wk.poll() is None
print('controller alive', ctl.poll() is None, 'worker alive', wk.poll() is None)
wk.terminate(); ctl.terminate(); wk.wait(); ctl.wait()
raise SystemExit(0 if alive and t.returncode == 0 else 1)
