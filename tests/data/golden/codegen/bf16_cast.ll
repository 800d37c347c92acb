; ModuleID = 'kiln_cpu'
source_filename = "kiln_cpu"
target datalayout = "e-m:e-p270:32:32-p271:32:32-p272:64:64-i64:64-f80:128-n8:16:32:64-S128"
target triple = "x86_64-pc-linux-gnu"

; Function Attrs: nounwind
define void @bf16_cast(ptr %buffers, i64 %begin, i64 %end) #0 {
entry:
  %0 = getelementptr inbounds ptr, ptr %buffers, i64 0
  %p0 = load ptr, ptr %0, align 8
  %1 = getelementptr inbounds ptr, ptr %buffers, i64 1
  %p1 = load ptr, ptr %1, align 8
  %2 = getelementptr inbounds ptr, ptr %buffers, i64 2
  %p2 = load ptr, ptr %2, align 8
  %3 = getelementptr inbounds ptr, ptr %buffers, i64 3
  %p3 = load ptr, ptr %3, align 8
  %4 = icmp slt i64 %begin, %end
  br i1 %4, label %loop, label %loop.end

loop:                                             ; preds = %loop, %entry
  %i = phi i64 [ %begin, %entry ], [ %78, %loop ]
  %5 = add nsw i64 0, %i
  %6 = getelementptr inbounds float, ptr %p0, i64 %5
  %7 = load float, ptr %6, align 4, !alias.scope !0, !noalias !3
  %8 = add nsw i64 0, %i
  %9 = getelementptr inbounds i16, ptr %p1, i64 %8
  %10 = load i16, ptr %9, align 2, !alias.scope !7, !noalias !8
  %11 = zext i16 %10 to i32
  %12 = shl i32 %11, 16
  %13 = bitcast i32 %12 to float
  %14 = bitcast float %7 to i32
  %15 = and i32 %14, 2147483647
  %16 = icmp ugt i32 %15, 2139095040
  %17 = lshr i32 %14, 16
  %18 = and i32 %17, 1
  %19 = add i32 %14, 32767
  %20 = add i32 %19, %18
  %21 = and i32 %20, -65536
  %22 = or i32 %14, 4194304
  %23 = and i32 %22, -65536
  %24 = select i1 %16, i32 %23, i32 %21
  %25 = bitcast i32 %24 to float
  %26 = call float @llvm.fabs.f32(float %13)
  %27 = fcmp olt float %26, 0x400F5C2900000000
  %28 = select i1 %27, float %26, float 0x400F5C2900000000
  %29 = fmul float %28, %28
  %30 = call float @llvm.fmuladd.f32(float %29, float 0x3FC0A8E3C0000000, float -1.000000e+00)
  %31 = call float @llvm.fmuladd.f32(float 0x3FB7332A60000000, float %30, float 0xBFBBF337E0000000)
  %32 = call float @llvm.fmuladd.f32(float %31, float %30, float 0x3FC129A440000000)
  %33 = call float @llvm.fmuladd.f32(float %32, float %30, float 0xBFC70DCC80000000)
  %34 = call float @llvm.fmuladd.f32(float %33, float %30, float 0x3FD7164FE0000000)
  %35 = call float @llvm.fmuladd.f32(float 0xBF94A7D940000000, float %30, float 0x3F9F5BAAA0000000)
  %36 = call float @llvm.fmuladd.f32(float %35, float %30, float 0xBFA63B14A0000000)
  %37 = call float @llvm.fmuladd.f32(float %36, float %30, float 0x3FADC82980000000)
  %38 = call float @llvm.fmuladd.f32(float %37, float %30, float 0xBFB2F2BC20000000)
  %39 = call float @llvm.fmuladd.f32(float 0x3F422DD620000000, float %30, float 0xBF61CDD040000000)
  %40 = call float @llvm.fmuladd.f32(float %39, float %30, float 0x3F71ED2F40000000)
  %41 = call float @llvm.fmuladd.f32(float %40, float %30, float 0xBF7D2CEBC0000000)
  %42 = call float @llvm.fmuladd.f32(float %41, float %30, float 0x3F88F21840000000)
  %43 = call float @llvm.fmuladd.f32(float 0xBF23E09620000000, float %30, float 0x3F39C5F3E0000000)
  %44 = call float @llvm.fmuladd.f32(float %43, float %30, float 0xBF33507620000000)
  %45 = fmul float %30, %30
  %46 = fmul float %45, %45
  %47 = fmul float %30, %46
  %48 = call float @llvm.fmuladd.f32(float %44, float %47, float %42)
  %49 = call float @llvm.fmuladd.f32(float %48, float %47, float %38)
  %50 = call float @llvm.fmuladd.f32(float %49, float %47, float %34)
  %51 = fmul float %28, %50
  %52 = select i1 %27, float %51, float 1.000000e+00
  %53 = call float @llvm.copysign.f32(float %52, float %13)
  %54 = fcmp uno float %13, %13
  %55 = select i1 %54, float %13, float %53
  %56 = bitcast float %55 to i32
  %57 = and i32 %56, 2147483647
  %58 = icmp ugt i32 %57, 2139095040
  %59 = lshr i32 %56, 16
  %60 = and i32 %59, 1
  %61 = add i32 %56, 32767
  %62 = add i32 %61, %60
  %63 = and i32 %62, -65536
  %64 = or i32 %56, 4194304
  %65 = and i32 %64, -65536
  %66 = select i1 %58, i32 %65, i32 %63
  %67 = bitcast i32 %66 to float
  %68 = bitcast float %25 to i32
  %69 = lshr i32 %68, 16
  %70 = trunc i32 %69 to i16
  %71 = add nsw i64 0, %i
  %72 = getelementptr inbounds i16, ptr %p2, i64 %71
  store i16 %70, ptr %72, align 2, !alias.scope !9, !noalias !10
  %73 = bitcast float %67 to i32
  %74 = lshr i32 %73, 16
  %75 = trunc i32 %74 to i16
  %76 = add nsw i64 0, %i
  %77 = getelementptr inbounds i16, ptr %p3, i64 %76
  store i16 %75, ptr %77, align 2, !alias.scope !11, !noalias !12
  %78 = add nsw i64 %i, 1
  %79 = icmp slt i64 %78, %end
  br i1 %79, label %loop, label %loop.end

loop.end:                                         ; preds = %loop, %entry
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
!3 = !{!4, !5, !6}
!4 = distinct !{!4, !2, !"p1"}
!5 = distinct !{!5, !2, !"p2"}
!6 = distinct !{!6, !2, !"p3"}
!7 = !{!4}
!8 = !{!1, !5, !6}
!9 = !{!5}
!10 = !{!1, !4, !6}
!11 = !{!6}
!12 = !{!1, !4, !5}
