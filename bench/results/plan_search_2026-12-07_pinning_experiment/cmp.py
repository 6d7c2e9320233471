import csv,sys
def load(d):
    rows={}
    with open(d+'/plan_search.tsv') as f:
        r=csv.DictReader(f,delimiter='\t')
        for x in r: rows[(x['model'],x['plan'])]=x
    return rows
a=load(sys.argv[1]); b=load(sys.argv[2])
n=0;w=0;worst=0
for k in a:
    if k not in b: continue
    ma=float(a[k]['measured_ms']); mb=float(b[k]['measured_ms'])
    d=mb/ma-1; n+=1; w+= abs(d)<=0.10; worst=max(worst,abs(d))
    pa=float(a[k]['predicted_ms']); pb=float(b[k]['predicted_ms'])
    print(f"{k[0]:7s} {k[1]:40s} meas {ma:8.2f} {mb:8.2f} {100*d:+6.1f}%  pred {pa:8.2f} {pb:8.2f}  err {100*(pa/ma-1):+5.0f}% {100*(pb/mb-1):+5.0f}%")
print(f"measured within 10%: {w} of {n}, worst {100*worst:.1f}%")
