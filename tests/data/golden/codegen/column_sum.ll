; ModuleID = 'kiln_cpu'
source_filename = "kiln_cpu"
target datalayout = "e-m:e-p270:32:32-p271:32:32-p272:64:64-i64:64-f80:128-n8:16:32:64-S128"
target triple = "x86_64-pc-linux-gnu"

; Function Attrs: nounwind
define void @column_sum(ptr %buffers, i64 %begin, i64 %end) #0 {
entry:
  %0 = alloca double, i64 256, align 8
  %1 = getelementptr inbounds ptr, ptr %buffers, i64 0
  %p0 = load ptr, ptr %1, align 8
  %2 = getelementptr inbounds ptr, ptr %buffers, i64 1
  %p1 = load ptr, ptr %2, align 8
  %3 = sub i64 %end, %begin
  %4 = add i64 %3, 255
  %5 = sdiv i64 %4, 256
  %6 = icmp slt i64 0, %5
  br i1 %6, label %loop, label %loop.end12

loop:                                             ; preds = %loop.end11, %entry
  %i = phi i64 [ 0, %entry ], [ %41, %loop.end11 ]
  %7 = mul nsw i64 %i, 256
  %8 = add nsw i64 %begin, %7
  %9 = sub i64 %end, %8
  %10 = icmp slt i64 %9, 256
  %11 = select i1 %10, i64 %9, i64 256
  %12 = icmp slt i64 0, %11
  br i1 %12, label %loop1, label %loop.end

loop1:                                            ; preds = %loop1, %loop
  %i2 = phi i64 [ 0, %loop ], [ %14, %loop1 ]
  %13 = getelementptr inbounds double, ptr %0, i64 %i2
  store double 0.000000e+00, ptr %13, align 8
  %14 = add nsw i64 %i2, 1
  %15 = icmp slt i64 %14, %11
  br i1 %15, label %loop1, label %loop.end

loop.end:                                         ; preds = %loop1, %loop
  br i1 true, label %loop3, label %loop.end8

loop3:                                            ; preds = %loop.end7, %loop.end
  %i4 = phi i64 [ 0, %loop.end ], [ %30, %loop.end7 ]
  %16 = icmp slt i64 0, %11
  br i1 %16, label %loop5, label %loop.end7

loop5:                                            ; preds = %loop5, %loop3
  %i6 = phi i64 [ 0, %loop3 ], [ %28, %loop5 ]
  %17 = add nsw i64 %8, %i6
  %18 = mul nsw i64 %i4, 32
  %19 = add nsw i64 0, %18
  %20 = add nsw i64 %19, %17
  %21 = getelementptr inbounds float, ptr %p0, i64 %20
  %22 = load float, ptr %21, align 4, !alias.scope !0, !noalias !3
  %23 = fmul float %22, %22
  %24 = getelementptr inbounds double, ptr %0, i64 %i6
  %25 = load double, ptr %24, align 8
  %26 = fpext float %23 to double
  %27 = fadd double %25, %26
  store double %27, ptr %24, align 8
  %28 = add nsw i64 %i6, 1
  %29 = icmp slt i64 %28, %11
  br i1 %29, label %loop5, label %loop.end7

loop.end7:                                        ; preds = %loop5, %loop3
  %30 = add nsw i64 %i4, 1
  %31 = icmp slt i64 %30, 64
  br i1 %31, label %loop3, label %loop.end8

loop.end8:                                        ; preds = %loop.end7, %loop.end
  %32 = icmp slt i64 0, %11
  br i1 %32, label %loop9, label %loop.end11

loop9:                                            ; preds = %loop9, %loop.end8
  %i10 = phi i64 [ 0, %loop.end8 ], [ %39, %loop9 ]
  %33 = add nsw i64 %8, %i10
  %34 = getelementptr inbounds double, ptr %0, i64 %i10
  %35 = load double, ptr %34, align 8
  %36 = fptrunc double %35 to float
  %37 = add nsw i64 0, %33
  %38 = getelementptr inbounds float, ptr %p1, i64 %37
  store float %36, ptr %38, align 4, !alias.scope !3, !noalias !0
  %39 = add nsw i64 %i10, 1
  %40 = icmp slt i64 %39, %11
  br i1 %40, label %loop9, label %loop.end11

loop.end11:                                       ; preds = %loop9, %loop.end8
  %41 = add nsw i64 %i, 1
  %42 = icmp slt i64 %41, %5
  br i1 %42, label %loop, label %loop.end12

loop.end12:                                       ; preds = %loop.end11, %entry
  ret void
}

attributes #0 = { nounwind "prefer-vector-width"="512" "target-cpu"="skylake-avx512" "target-features"="+avx,+avx2,+avx512bw,+avx512dq,+avx512f,+avx512vl,+f16c,+fma" }

!0 = !{!1}
!1 = distinct !{!1, !2, !"p0"}
!2 = distinct !{!2, !"kiln.buffers"}
!3 = !{!4}
!4 = distinct !{!4, !2, !"p1"}
