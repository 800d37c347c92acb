; ModuleID = 'kiln_cpu'
source_filename = "kiln_cpu"
target datalayout = "e-m:e-p270:32:32-p271:32:32-p272:64:64-i64:64-f80:128-n8:16:32:64-S128"
target triple = "x86_64-pc-linux-gnu"

; Function Attrs: nounwind
define void @pointwise_chain(ptr %buffers, i64 %begin, i64 %end) #0 {
entry:
  %0 = getelementptr inbounds ptr, ptr %buffers, i64 0
  %p0 = load ptr, ptr %0, align 8
  %1 = getelementptr inbounds ptr, ptr %buffers, i64 1
  %p1 = load ptr, ptr %1, align 8
  %2 = getelementptr inbounds ptr, ptr %buffers, i64 2
  %p2 = load ptr, ptr %2, align 8
  %3 = icmp slt i64 %begin, %end
  br i1 %3, label %loop, label %loop.end3

loop:                                             ; preds = %loop.end, %entry
  %i = phi i64 [ %begin, %entry ], [ %75, %loop.end ]
  br i1 true, label %loop1, label %loop.end

loop1:                                            ; preds = %loop1, %loop
  %i2 = phi i64 [ 0, %loop ], [ %73, %loop1 ]
  %4 = mul nsw i64 %i, 8
  %5 = add nsw i64 0, %4
  %6 = add nsw i64 %5, %i2
  %7 = getelementptr inbounds float, ptr %p0, i64 %6
  %8 = load float, ptr %7, align 4, !alias.scope !0, !noalias !3
  %9 = add nsw i64 0, %i2
  %10 = getelementptr inbounds float, ptr %p1, i64 %9
  %11 = load float, ptr %10, align 4, !alias.scope !6, !noalias !7
  %12 = fmul float %8, 5.000000e-01
  %13 = fadd float %12, %11
  %14 = call float @llvm.fabs.f32(float %13)
  %15 = fcmp olt float %14, 0x3FE19999A0000000
  %16 = select i1 %15, float %14, float 0x3FE19999A0000000
  %17 = fmul float %16, %16
  %18 = fmul float %17, 0x401A723F80000000
  %19 = fadd float %18, -1.000000e+00
  %20 = call float @llvm.fmuladd.f32(float 0xBEA08E75A0000000, float %19, float 0x3EE1EA78E0000000)
  %21 = call float @llvm.fmuladd.f32(float %20, float %19, float 0xBF234AF720000000)
  %22 = call float @llvm.fmuladd.f32(float %21, float %19, float 0x3F64E86E40000000)
  %23 = call float @llvm.fmuladd.f32(float %22, float %19, float 0xBFA6F47960000000)
  %24 = call float @llvm.fmuladd.f32(float %23, float %19, float 0x3FEE7A8860000000)
  %25 = fmul float %16, %24
  %26 = fcmp olt float %14, 0x4022333340000000
  %27 = select i1 %26, float %14, float 0x4022333340000000
  %28 = fadd float %27, %27
  %29 = fcmp olt float %28, 0xC059FE3680000000
  %30 = select i1 %29, float 0.000000e+00, float %28
  %31 = fcmp ogt float %30, 8.900000e+01
  %32 = select i1 %31, float 8.900000e+01, float %30
  %33 = call float @llvm.fmuladd.f32(float %32, float 0x3FF7154760000000, float 0x4168000000000000)
  %34 = fsub float %33, 0x4168000000000000
  %35 = call float @llvm.fmuladd.f32(float %34, float 0xBFE6300000000000, float %32)
  %36 = call float @llvm.fmuladd.f32(float %34, float 0x3F2BD01060000000, float %35)
  %37 = call float @llvm.fmuladd.f32(float 0x3F2A0D2CE0000000, float %36, float 0x3F56E879C0000000)
  %38 = call float @llvm.fmuladd.f32(float %37, float %36, float 0x3F81112100000000)
  %39 = call float @llvm.fmuladd.f32(float %38, float %36, float 0x3FA5553820000000)
  %40 = call float @llvm.fmuladd.f32(float %39, float %36, float 0x3FC5555540000000)
  %41 = call float @llvm.fmuladd.f32(float %40, float %36, float 5.000000e-01)
  %42 = fmul float %36, %36
  %43 = fmul float %41, %42
  %44 = fadd float %43, %36
  %45 = fadd float %44, 1.000000e+00
  %46 = bitcast float %33 to i32
  %47 = sub i32 %46, 1262485504
  %48 = ashr i32 %47, 1
  %49 = sub i32 %47, %48
  %50 = add i32 %49, 127
  %51 = shl i32 %50, 23
  %52 = bitcast i32 %51 to float
  %53 = add i32 %48, 127
  %54 = shl i32 %53, 23
  %55 = bitcast i32 %54 to float
  %56 = fmul float %45, %55
  %57 = fmul float %56, %52
  %58 = select i1 %29, float 0.000000e+00, float %57
  %59 = fcmp uno float %28, %28
  %60 = select i1 %59, float %28, float %58
  %61 = fadd float %60, 1.000000e+00
  %62 = fdiv float 2.000000e+00, %61
  %63 = fsub float 1.000000e+00, %62
  %64 = fcmp olt float %14, 0x3FE19999A0000000
  %65 = select i1 %64, float %25, float %63
  %66 = call float @llvm.copysign.f32(float %65, float %13)
  %67 = fcmp uno float %13, %13
  %68 = select i1 %67, float %13, float %66
  %69 = mul nsw i64 %i, 8
  %70 = add nsw i64 0, %69
  %71 = add nsw i64 %70, %i2
  %72 = getelementptr inbounds float, ptr %p2, i64 %71
  store float %68, ptr %72, align 4, !alias.scope !8, !noalias !9
  %73 = add nsw i64 %i2, 1
  %74 = icmp slt i64 %73, 8
  br i1 %74, label %loop1, label %loop.end

loop.end:                                         ; preds = %loop1, %loop
  %75 = add nsw i64 %i, 1
  %76 = icmp slt i64 %75, %end
  br i1 %76, label %loop, label %loop.end3

loop.end3:                                        ; preds = %loop.end, %entry
  ret void
}

; Function Attrs: nocallback nofree nosync nounwind speculatable willreturn memory(none)
declare float @llvm.fabs.f32(float) #1

; Function Attrs: nocallback nofree nosync nounwind speculatable willreturn memory(none)
declare float @llvm.fmuladd.f32(float, float, float) #1

; Function Attrs: nocallback nofree nosync nounwind speculatable willreturn memory(none)
declare float @llvm.copysign.f32(float, float) #1

attributes #0 = { nounwind "prefer-vector-width"="512" "target-cpu"="skylake-avx512" "target-features"="+avx,+avx2,+avx512bw,+avx512dq,+avx512f,+avx512vl,+f16c,+fma" }
attributes #1 = { nocallback nofree nosync nounwind speculatable willreturn memory(none) }

!0 = !{!1}
!1 = distinct !{!1, !2, !"p0"}
!2 = distinct !{!2, !"kiln.buffers"}
!3 = !{!4, !5}
!4 = distinct !{!4, !2, !"p1"}
!5 = distinct !{!5, !2, !"p2"}
!6 = !{!4}
!7 = !{!1, !5}
!8 = !{!5}
!9 = !{!1, !4}
